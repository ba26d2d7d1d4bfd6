"""The torch engine's optimizer from ``optim.*`` (AdamW, fused where the device has it; SGD;
ZeRO-1; master-weight AdamW) and grad clipping that is correct for sharded grads."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from longboat.core.config.errors import ConfigError, require_choice
from longboat.core.config.schema import OptimConfig
from longboat.core.engine.torch.master_weights import (
    MASTER_STORAGES,
    MOMENT_DTYPES,
    MasterWeightAdamW,
)
from longboat.core.engine.torch.strategy import ParallelSetup, check_master_weights

# Device types whose torch build ships a fused AdamW kernel.
_FUSED_ADAMW_DEVICES = ("cuda", "cpu", "xpu", "mps", "hpu")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable params split into decayed (matrices) and not decayed (biases, norms, scalars)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


MASTER_UPDATES = ("slices", "kernel")
"""``train.master_weight_update`` values: ``torch._fused_adamw_`` slices, or the one-pass
kernel where it runs compiled."""


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    setup: ParallelSetup,
    *,
    master_weights: bool = False,
    master_storage: str = "fp32",
    master_update: str = "slices",
    master_weight_class: type[MasterWeightAdamW] = MasterWeightAdamW,
    master_kernel_impl: Callable[[torch.Tensor], str | None] | None = None,
    master_seed: int = 0,
) -> torch.optim.Optimizer:
    """AdamW (or SGD) over the trainable params; ZeroRedundancyOptimizer for ``zero1``.

    ``master_weights``: ``MasterWeightAdamW`` (see master_weights.py), which turns the
    trainable params into bf16 views of one flat buffer with fp32 master weights in the
    optimizer; pair it with ``parallelize(..., master_weights=True)``.
    ``master_storage`` (``train.master_weight_storage``): how it stores the masters,
    ``"fp32"``, ``"split"`` (the same masters in 2 bytes a parameter less) or ``"bf16_sr"``
    (no masters: bf16 weights updated with stochastic rounding seeded by ``master_seed``;
    changes numerics). ``cfg.moment_dtype`` (``optim.moment_dtype``): fp32 or bf16 moments
    (bf16 needs ``master_weights``; changes numerics).
    ``master_update`` (``train.master_weight_update``): ``"slices"`` (``torch._fused_adamw_``
    per slice) or ``"kernel"`` (one Triton ``adamw_master_step_`` pass per param group where
    Triton runs compiled, i.e. on CUDA unless ``LONGBOAT_KERNELS_IMPL=torch``; the slices
    elsewhere). The kernel is the caller's (core does not import the kernels package):
    ``master_weight_class``, a ``MasterWeightAdamW`` subclass that passes its ``kernel``
    (``longboat.kernels.adamw_master_step_``), and ``master_kernel_impl``, which names the
    implementation to run for a parameter (``"triton"``) or None where only the slices apply;
    without it ``"kernel"`` runs the slices.
    """
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        raise ConfigError(
            "the model has no trainable parameters",
            key="model",
            fix="unfreeze some parameters (the model config's freezing options)",
        )
    moment_dtype = cfg.moment_dtype or "fp32"
    require_choice(
        moment_dtype, tuple(MOMENT_DTYPES), key="optim.moment_dtype", what="moment dtype"
    )
    if moment_dtype != "fp32" and not master_weights:
        raise ConfigError(
            "bf16 optimizer moments are kept by the master-weight optimizer only",
            key="optim.moment_dtype",
            value=moment_dtype,
            fix="set train.master_weights=true (with train.precision=bf16) or "
            "optim.moment_dtype=fp32",
        )
    if master_weights:
        check_master_weights(setup.strategy)
        if cfg.name != "adamw":
            raise ConfigError(
                "master weights are implemented for AdamW only",
                key="train.master_weights",
                value=True,
                fix="set optim.name=adamw or train.master_weights=false",
            )
        require_choice(
            master_update, MASTER_UPDATES, key="train.master_weight_update",
            what="master-weight update",
        )  # fmt: skip
        require_choice(
            master_storage, MASTER_STORAGES, key="train.master_weight_storage",
            what="master-weight storage",
        )  # fmt: skip
        return master_weight_class(
            groups,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            master_storage=master_storage,
            moment_dtype=MOMENT_DTYPES[moment_dtype],
            seed=master_seed,
            kernel_impl=_kernel_impl(master_update, groups, master_kernel_impl),
        )
    if cfg.name == "adamw":
        cls: type[torch.optim.Optimizer] = torch.optim.AdamW
        kwargs: dict = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
        if cfg.fused and setup.device_type in _FUSED_ADAMW_DEVICES:
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = True
    elif cfg.name == "sgd":
        cls, kwargs = torch.optim.SGD, {"lr": cfg.lr, "momentum": 0.9}
    else:
        raise ConfigError(
            "unknown optimizer", key="optim.name", value=cfg.name, fix="use adamw or sgd"
        )
    if setup.strategy == "zero1" and setup.distributed:
        first, *rest = groups
        zero = ZeroRedundancyOptimizer(
            first["params"], optimizer_class=cls, weight_decay=first["weight_decay"], **kwargs
        )
        for group in rest:
            zero.add_param_group(group)
        return zero
    return cls(groups, **kwargs)


def _kernel_impl(
    update: str,
    groups: list[dict],
    impl_for: Callable[[torch.Tensor], str | None] | None,
) -> str | None:
    """``MasterWeightAdamW``'s ``kernel_impl`` for ``train.master_weight_update``: the kernel's
    implementation for the first parameter (e.g. Triton only where it runs compiled: an
    interpreted kernel is for tests, not training), None for the slices."""
    if update != "kernel" or impl_for is None:
        return None
    return impl_for(next(p for g in groups for p in g["params"]))


@torch.no_grad()
def clip_grad_norm_(
    parameters: list[nn.Parameter], max_norm: float, *, foreach: bool = True
) -> torch.Tensor:
    """Global grad-norm clipping that is correct for sharded (DTensor) grads.

    FSDP2 grads are DTensor shards: the per-shard norms are reduced over the mesh
    (``full_tensor``) before the clip coefficient is computed, so every rank
    clips with the norm of the whole model. ``max_norm <= 0`` only measures.
    Returns the total norm (before clipping) as a plain tensor.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=foreach)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=foreach)
    return total
