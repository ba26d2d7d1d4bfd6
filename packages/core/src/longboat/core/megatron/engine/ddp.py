"""megatron's DDP + distributed optimizer of the step engine, built from ``optim.*``.

``wrap_and_build`` wraps each model chunk in megatron's ``DistributedDataParallel`` (grads in
contiguous buffers, reduce-scattered over data-parallel ranks) and builds the
``DistributedOptimizer`` through ``core.megatron.optimizer.megatron_optimizer`` (optimizer
state and fp32 main weights sharded over DP ranks, matrix-only weight decay, torch's fused
AdamW). ``construction_stream`` is the side stream under which DDP must be constructed for a
step captured as a CUDA graph. Checkpoint state: ``core.megatron.optimizer.MegatronOptimizerState``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.optimizer import megatron_optimizer

_OPTIMIZERS = {"adamw": "adam", "sgd": "sgd"}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wrap_and_build(
    chunks: list[torch.nn.Module],
    optim: Any,
    *,
    precision: str,
    grad_reduce_in_fp32: bool = True,
    side_stream: bool = False,
) -> tuple[list[torch.nn.Module], Any]:
    """(DDP-wrapped chunks, megatron distributed optimizer) for ``optim`` (an OptimConfig).

    ``grad_reduce_in_fp32=False``: a bf16 grad buffer (for ``core.megatron.wgrad``'s
    single-pass gradients, where it holds the same values as an fp32 one).
    ``side_stream``: construct the DDP wrappers under a side stream of the accelerator, which
    a step captured as a CUDA graph needs. megatron's DDP creates every parameter's
    grad-accumulation node in its constructor and keeps it; autograd runs that node on the
    stream current at its creation, and on the legacy default stream it would make that
    stream wait on the capturing one during the captured backward, which CUDA refuses
    ("operation would make the legacy stream depend on a capturing blocking stream").
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    if optim.name not in _OPTIMIZERS:
        raise ConfigError(
            "unknown optimizer", key="optim.name", value=optim.name, fix="use adamw or sgd"
        )
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        use_distributed_optimizer=True,
        overlap_grad_reduce=False,
    )
    with construction_stream(side_stream):
        model = [
            DistributedDataParallel(
                config=c.config, ddp_config=ddp_cfg, module=c, disable_bucketing=i > 0
            )
            for i, c in enumerate(chunks)
        ]
    betas = list(optim.betas)
    opt_cfg = OptimizerConfig(
        optimizer=_OPTIMIZERS[optim.name],
        lr=float(optim.lr),
        min_lr=0.0,
        weight_decay=float(optim.weight_decay),
        adam_beta1=float(betas[0]),
        adam_beta2=float(betas[1]),
        adam_eps=float(optim.eps),
        sgd_momentum=0.0,
        clip_grad=float(optim.grad_clip),
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=_DTYPES[precision],
        use_distributed_optimizer=True,
    )
    # matrix-only weight decay; torch's fused AdamW on CUDA when TE / apex are absent
    optimizer = megatron_optimizer(opt_cfg, model, fused=getattr(optim, "fused", True))
    return model, optimizer


@contextlib.contextmanager
def construction_stream(side: bool) -> Iterator[None]:
    """Run the body under a fresh side stream of the accelerator (``side``), ordered after
    the current stream's work and followed by it."""
    if not side:
        yield
        return
    from longboat.core.device import get_accelerator

    acc = get_accelerator()
    stream = acc.stream()
    stream.wait_stream(acc.current_stream())
    with acc.use_stream(stream):
        yield
    acc.current_stream().wait_stream(stream)


__all__ = ["construction_stream", "wrap_and_build"]
