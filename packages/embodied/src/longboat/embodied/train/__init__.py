"""Embodied training: ``trainer.train(cfg)`` and its parts.

- ``trainer``: compose -> validate -> build -> train -> checkpoint -> export.
- ``step``: one optimizer step over accumulated micro-batches (world-size invariant).
- ``plan`` / ``loader``: which samples each rank trains on at each step.
- ``datasets``: the run's LeRobot dataset (synthetic on first use).
- ``policy_batch``: LeRobot samples -> policy batch.
- ``export``: ``model.safetensors`` + ``config.json`` and ``load_exported_policy``.

Kept import-free so ``longboat stacks`` stays cheap; import the submodules.
"""
