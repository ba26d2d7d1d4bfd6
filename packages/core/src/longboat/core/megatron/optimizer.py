"""Distributed-optimizer glue: longboat's ``OptimConfig`` -> megatron DDP + optimizer."""

from __future__ import annotations

from typing import Any

import torch

from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import OptimConfig

_PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wrap_ddp(
    chunks: list[torch.nn.Module],
    *,
    distributed_optimizer: bool = False,
    overlap_grad_reduce: bool = False,
) -> list[torch.nn.Module]:
    """Wrap each model chunk in megatron's ``DistributedDataParallel`` (fp32 grad buffers)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=distributed_optimizer,
    )
    return [DistributedDataParallel(config=c.config, ddp_config=ddp_cfg, module=c) for c in chunks]


def build_optimizer(
    ddp_chunks: list[torch.nn.Module],
    optim: OptimConfig,
    *,
    precision: str = "fp32",
    distributed_optimizer: bool = False,
) -> Any:
    """megatron optimizer for ``optim`` (adamw / sgd), fp32 main params under bf16 / fp16.

    ``distributed_optimizer`` shards optimizer state over data-parallel ranks (ZeRO-1;
    megatron supports it for Adam only).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    kinds = {"adamw": "adam", "sgd": "sgd"}
    if optim.name not in kinds:
        raise ConfigError(
            f"optim.name={optim.name!r}: the megatron backend supports {sorted(kinds)}.",
            key="optim.name",
        )
    if distributed_optimizer and optim.name != "adamw":
        raise ConfigError(
            "megatron's distributed optimizer supports Adam(W) only. Fix: optim.name=adamw "
            "or turn the distributed optimizer off.",
            key="optim.name",
            value=optim.name,
        )
    if precision not in _PARAM_DTYPES:
        raise ConfigError(f"train.precision={precision!r}: expected fp32, bf16 or fp16.")
    cfg = OptimizerConfig(
        optimizer=kinds[optim.name],
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=float(optim.betas[0]),
        adam_beta2=float(optim.betas[1]),
        adam_eps=optim.eps,
        clip_grad=optim.grad_clip,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=_PARAM_DTYPES[precision],
        use_distributed_optimizer=distributed_optimizer,
    )
    return get_megatron_optimizer(cfg, ddp_chunks)
