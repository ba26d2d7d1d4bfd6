"""The embodied stack's parallel layer: core's torch step engine (``longboat.core.engine.torch``:
DDP / ZeRO-1 / FSDP2 / HSDP, recompute, compile, the optimizer, master weights) with what the
stack binds into it (``bindings``: its policies' block methods, longboat's AdamW kernel)."""

from longboat.core.distributed import STRATEGIES
from longboat.core.engine import MASTER_WEIGHT_STRATEGIES
from longboat.core.engine.torch.blocks import compile_blocks, find_blocks
from longboat.core.engine.torch.master_weights import MASTER_STORAGES
from longboat.core.engine.torch.optim import clip_grad_norm_, param_groups
from longboat.core.engine.torch.recompute import AC_MODES, apply_activation_checkpointing
from longboat.core.engine.torch.strategy import (
    ParallelSetup,
    build_mesh,
    check_master_weights,
    unwrap,
)
from longboat.core.engine.torch.zero_state import ZeroShardState
from longboat.embodied.parallel.bindings import (
    KNOWN_BLOCK_METHODS,
    MasterWeightAdamW,
    block_methods,
    build_optimizer,
    parallelize,
)

__all__ = [
    "AC_MODES",
    "KNOWN_BLOCK_METHODS",
    "MASTER_STORAGES",
    "MASTER_WEIGHT_STRATEGIES",
    "STRATEGIES",
    "MasterWeightAdamW",
    "ParallelSetup",
    "ZeroShardState",
    "apply_activation_checkpointing",
    "block_methods",
    "build_mesh",
    "build_optimizer",
    "check_master_weights",
    "clip_grad_norm_",
    "compile_blocks",
    "find_blocks",
    "parallelize",
    "param_groups",
    "unwrap",
]
