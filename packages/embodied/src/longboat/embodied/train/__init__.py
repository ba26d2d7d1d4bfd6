"""Embodied training: ``trainer.train(cfg)`` and its parts.

- ``trainer``: ``train(cfg)``, the embodied run on core's trainer (``longboat.core.train``).
- ``training``: ``build_training(cfg)``, the one assembly of a run (``EmbodiedTraining``).
- the step itself is core's torch step engine (``longboat.core.engine.torch``): accumulated
  micro-batches (world-size invariant), the sync-free ``GraphableStep`` and its ``LaggedGuard``.
- ``plan`` / ``loader``: which samples each rank trains on at each step.
- ``datasets``: the run's LeRobot dataset (synthetic on first use).
- ``policy_batch``: LeRobot samples -> policy batch.
- ``export``: ``model.safetensors`` + ``config.json`` and ``load_exported_policy``.

Kept import-free so ``longboat stacks`` stays cheap; import the submodules.
"""
