"""The megatron backend of the step engine (llm, vlm, diffusion).

- ``step_engine.MegatronStepEngine``: the base of a stack's step: the update, the gate, one
  trainer step; a stack gives it its optimizer and ``forward_backward``.
- ``ddp.wrap_and_build``: megatron DDP + distributed optimizer from ``optim.*`` (optionally
  constructed under a side stream for a captured step).
- ``lagged_gate``: the NaN gate with the skip on the device and the verdict one step late.
- ``graphed_step``: the whole step replayed as one CUDA graph (``train.cuda_graph``).
- ``one_pass_adamw``: the distributed optimizer's update as one kernel pass per shard.
- ``moments``: ``optim.moment_dtype`` on this engine (bf16 moments through the one-pass
  update; where they are refused, and what the memory plan may choose).
- ``memory_plan``: a decoder's predicted peak from its shapes and the choice of recompute and
  micro-batch split for ``train.memory_budget``.
"""

from typing import Any

__all__ = ["MegatronStepEngine"]


def __getattr__(name: str) -> Any:
    # Lazy: the config validators in ``moments`` are imported while a config composes, which
    # must not import torch (``step_engine`` does).
    if name == "MegatronStepEngine":
        from longboat.core.megatron.engine.step_engine import MegatronStepEngine

        return MegatronStepEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
