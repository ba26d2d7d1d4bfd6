"""Training diffusion transformers on core's trainer (``longboat-diffusion train``).

- :mod:`~longboat.diffusion.train.schema`: the typed experiment config.
- :mod:`~longboat.diffusion.train.checks`: every config check, before anything heavy.
- :mod:`~longboat.diffusion.train.training`: ``DiffusionTraining`` / ``build_training`` /
  ``train``.
- :mod:`~longboat.diffusion.train.step`: one flow-matching step on megatron DDP + the
  distributed optimizer; the held-out loss.
- :mod:`~longboat.diffusion.train.data`: the run's loaders; :mod:`~longboat.diffusion.train.preview`:
  the end-of-run GIF of sampled held-out captions.
"""
