"""The torch backend of the step engine (the embodied stack's; any plain ``nn.Module``).

A stack gives it a model whose ``model(batch)`` returns a dict with a scalar ``loss`` (other
scalar entries are reported as metrics) and its batches; the engine owns the rest:

- ``strategy``: ``ParallelSetup`` and ``parallelize`` (activation recompute, then DDP /
  ZeRO-1 / FSDP2 / HSDP from ``parallel.strategy``);
- ``optim``: the optimizer from ``optim.*`` (fused AdamW, SGD, ZeRO-1, master-weight AdamW)
  and grad clipping that is correct for sharded grads; ``zero_state``: ZeRO-1's per-rank
  checkpoint entry;
- ``master_weights``: ``MasterWeightAdamW`` (bf16 params as views of flat buffers, fp32
  masters, one fused update per group; ``bf16_split``: the 14-byte master storage);
- ``step``: the eager step (``train_step``: gradient accumulation, world-size invariant
  micro-batch seeding, autocast, the synchronous gate);
- ``graphable``: the sync-free step (``GraphableStep``, captured with ``train.cuda_graph``),
  its lagged NaN gate (``LaggedGuard``) and ``run_step``;
- ``blocks`` / ``recompute``: the model's repeated blocks, per-block recompute and compile;
- ``engine``: the assembly a stack calls: ``prepare_model``, ``build_step_fn``,
  ``make_gate``.

Import the submodules (this ``__init__`` imports nothing).
"""
