"""What the embodied stack binds into core's torch step engine (``longboat.core.engine.torch``):
the block methods of its policies and longboat's one-pass AdamW kernel for master weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from longboat.core.config.schema import OptimConfig
from longboat.core.engine.torch import blocks as core_blocks
from longboat.core.engine.torch import master_weights as core_master_weights
from longboat.core.engine.torch import optim as core_optim
from longboat.core.engine.torch import strategy as core_strategy
from longboat.kernels import adamw_master_step_

KNOWN_BLOCK_METHODS = ("project_qkv", "finish")
"""Methods through which a policy runs a block without calling the block itself: pi0.5's
joint attention drives each LM / expert layer as ``project_qkv`` then ``finish``. FSDP hooks
must see those calls."""


def block_methods(block: nn.Module) -> list[str]:
    """Non-``forward`` methods a policy calls to run ``block`` (its ``block_forward_methods``,
    else those of ``KNOWN_BLOCK_METHODS`` it has)."""
    return core_blocks.block_methods(block, KNOWN_BLOCK_METHODS)


def parallelize(model: nn.Module, setup: core_strategy.ParallelSetup, **kwargs: Any) -> nn.Module:
    """Core's ``parallelize`` with the policies' block methods (``KNOWN_BLOCK_METHODS``)."""
    kwargs.setdefault("known_block_methods", KNOWN_BLOCK_METHODS)
    return core_strategy.parallelize(model, setup, **kwargs)


class MasterWeightAdamW(core_master_weights.MasterWeightAdamW):
    """Core's ``MasterWeightAdamW`` with ``longboat.kernels.adamw_master_step_`` as its
    one-pass update (``kernel_impl="triton"`` / ``"torch"``)."""

    def __init__(self, groups: list[dict[str, Any]], **kwargs: Any) -> None:
        kwargs.setdefault("kernel", adamw_master_step_)
        super().__init__(groups, **kwargs)


def _kernel_impl(param: torch.Tensor) -> str | None:
    """The one-pass kernel only where Triton runs compiled (an interpreted kernel is for
    tests, not training): on CUDA unless ``LONGBOAT_KERNELS_IMPL=torch``."""
    from longboat.kernels._dispatch import resolve_impl

    return "triton" if param.is_cuda and resolve_impl(None, param) == "triton" else None


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    setup: core_strategy.ParallelSetup,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Core's ``build_optimizer`` with longboat's AdamW kernel for
    ``train.master_weight_update=kernel``."""
    kwargs.setdefault("master_weight_class", MasterWeightAdamW)
    kwargs.setdefault("master_kernel_impl", _kernel_impl)
    return core_optim.build_optimizer(model, cfg, setup, **kwargs)
