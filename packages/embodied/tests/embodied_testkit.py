"""Helpers shared by the embodied tests (not a test module: no ``test_`` prefix; importable
because conftest.py puts this folder on ``sys.path``): the tiny GR00T model with its
optimizer on a one-process CPU setup, its synthetic batches, and ``train_step`` as those
tests call it."""

from __future__ import annotations

import torch
from torch import nn

from longboat.core.config.schema import OptimConfig
from longboat.embodied.models import apply_freezing, build_model
from longboat.embodied.models.synthetic import synthetic_batch
from longboat.embodied.parallel import ParallelSetup, build_optimizer, parallelize
from longboat.embodied.train.step import StepResult, train_step

SETUP = ParallelSetup(strategy="ddp", world_size=1, rank=0)


def tiny_groot(
    optim: OptimConfig, *, master_weights: bool = True, storage: str = "fp32"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``groot_n1_6`` tiny, seed 0, frozen as configured, bf16 on ``SETUP``, and its optimizer
    (``MasterWeightAdamW`` with ``storage`` when ``master_weights``)."""
    torch.manual_seed(0)
    model = build_model("groot_n1_6", "tiny")
    apply_freezing(model)
    model = parallelize(model, SETUP, precision="bf16", master_weights=master_weights)
    optimizer = build_optimizer(
        model, optim, SETUP, master_weights=master_weights, master_storage=storage
    )
    return model, optimizer


def tiny_groot_batches(count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` synthetic batches of 2 for the tiny GR00T (seed 1)."""
    torch.manual_seed(1)
    model = build_model("groot_n1_6", "tiny")
    return [synthetic_batch(model, 2) for _ in range(count)]


def cpu_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    step: int,
    grad_clip: float,
    **kwargs,
) -> StepResult:
    """``train_step`` on one micro-batch, on CPU in bf16 autocast, seed 3, rank offset 0;
    ``kwargs`` (``should_step``, ``scheduler``...) pass through."""
    return train_step(
        model,
        optimizer,
        [batch],
        step=step,
        seed=3,
        rank_offset=0,
        device_type="cpu",
        precision="bf16",
        grad_clip=grad_clip,
        **kwargs,
    )
