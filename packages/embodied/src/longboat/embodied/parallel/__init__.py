"""Data-parallel strategies (ddp, zero1, fsdp, hsdp), activation checkpointing, optimizer."""

from longboat.embodied.parallel.blocks import compile_blocks, find_blocks
from longboat.embodied.parallel.checkpointing import AC_MODES, apply_activation_checkpointing
from longboat.embodied.parallel.master_weights import MasterWeightAdamW
from longboat.embodied.parallel.optim import build_optimizer, clip_grad_norm_, param_groups
from longboat.embodied.parallel.state import ZeroShardState
from longboat.embodied.parallel.strategy import (
    MASTER_WEIGHT_STRATEGIES,
    STRATEGIES,
    ParallelSetup,
    build_mesh,
    check_master_weights,
    parallelize,
    unwrap,
)

__all__ = [
    "AC_MODES",
    "MASTER_WEIGHT_STRATEGIES",
    "STRATEGIES",
    "MasterWeightAdamW",
    "ParallelSetup",
    "ZeroShardState",
    "apply_activation_checkpointing",
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
