"""The step engine: what every stack's step shares below its forward and loss.

Two backends, one set of levers (``optim.*``, gradient accumulation, main / master weights,
the synchronous or lagged NaN gate, CUDA-graph capture, the fused update, ``train.recompute``,
``train.compile``):

- megatron (llm, vlm, diffusion): ``longboat.core.megatron.engine`` (only
  ``longboat.core.megatron`` may import megatron);
- torch (embodied): ``longboat.core.engine.torch`` (plain ``nn.Module`` s: DDP, ZeRO-1, FSDP2,
  HSDP; master weights; no megatron).

Both take core's gates (``longboat.core.train.gate``: the synchronous ``UpdateGate`` and the
``LaggedUpdateGate`` base), device LR table (``longboat.core.train.schedule``) and CUDA-graph
helper (``longboat.core.loop.cuda_graph``).

``levers`` (import-free) resolves which of the torch backend's levers a run takes
(``train.master_weights`` / ``train.cuda_graph`` null: on where they apply). Kept import-free
(config validation reads ``MASTER_WEIGHT_STRATEGIES`` and ``levers`` without torch).
"""

MASTER_WEIGHT_STRATEGIES = ("ddp",)
"""``parallel.strategy`` values the torch engine's master weights support (the sharded
strategies keep their own parameter storage, so their params cannot be views of one flat
buffer)."""

__all__ = ["MASTER_WEIGHT_STRATEGIES"]
