"""The engine's memory plan: predict a run's peak device memory and choose the levers that
make it fit ``train.memory_budget``.

- ``budget`` (import-free): the ``train.memory_budget`` key (``auto``: about 90% of the
  accelerator's free memory; a number of GB), checked at compose time and resolved to bytes;
- ``states``: exact bytes of the weights, gradients, master weights and optimizer moments of
  a model under an ``OptimizerLayout`` (master weights on / off, their storage, fp32 / bf16
  moments, ZeRO-1 / FSDP sharding);
- ``activations``: the bytes each block saves for the backward, measured with saved-tensor
  hooks on a probe forward (on the meta device at the run's real shapes, or on CPU), as a
  per-sample slope plus a fixed part, so they scale to the run's micro-batch;
- ``plan``: the chooser (per-block recompute, selective first; bf16 moments where the stack
  offers them; the micro-batch split), its one-line report and the measured-peak line.

Import the submodules (this ``__init__`` imports nothing).
"""
