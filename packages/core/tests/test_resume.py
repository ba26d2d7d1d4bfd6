"""Exact resume: 20 uninterrupted steps == 10 steps + save + fresh state + load + 10 steps.

The run has everything that makes resume hard: AdamW moments, a warmup+cosine LR
schedule, dropout (RNG), a shuffled stateful sampler that crosses epoch
boundaries, and NaN-guard counters. Losses must match bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from longboat.core.checkpoint import CheckpointManager
from longboat.core.config.schema import CheckpointConfig, LRScheduleConfig, NaNGuardConfig
from longboat.core.data.sampler import StatefulDistributedSampler
from longboat.core.loop import NaNGuard, build_lr_scheduler
from longboat.core.rng import RNGState, seed_everything

TOTAL = 20
HALF = 10


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(42)
    x = torch.randn(52, 8, generator=g)  # 52 / batch 8 -> 7 batches an epoch, epochs roll over
    y = x @ torch.randn(8, 2, generator=g) + 0.1 * torch.randn(52, 2, generator=g)
    return TensorDataset(x, y)


def _build(init_seed: int) -> dict:
    seed_everything(init_seed)
    model = nn.Sequential(
        nn.Linear(8, 32),
        nn.GELU(),
        nn.Dropout(0.3),
        nn.Linear(32, 32),
        nn.Dropout(0.3),
        nn.Linear(32, 2),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    sched = build_lr_scheduler(optim, LRScheduleConfig(name="cosine", warmup_steps=4), TOTAL)
    sampler = StatefulDistributedSampler(_dataset(), num_replicas=1, rank=0, seed=7)
    return {
        "model": model,
        "optim": optim,
        "lr_scheduler": sched,
        "sampler": sampler,
        "nan_guard": NaNGuard(NaNGuardConfig()),
        "rng": RNGState(),
        "step": 0,
    }


def _batches(state: dict) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    # A DataLoader draws a base seed every time it is iterated; its own generator keeps
    # that draw off the global RNG, which a resumed run would otherwise see shifted.
    loader = DataLoader(
        _dataset(),
        batch_size=8,
        sampler=state["sampler"],
        num_workers=0,
        generator=torch.Generator().manual_seed(0),
    )
    while True:
        yield from loader


def _train(state: dict, steps: int) -> list[torch.Tensor]:
    model, optim = state["model"], state["optim"]
    model.train()
    losses = []
    batches = _batches(state)
    for _ in range(steps):
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if state["nan_guard"].check(loss, norm):
            optim.step()
            state["lr_scheduler"].step()
        optim.zero_grad(set_to_none=True)
        state["step"] += 1
        losses.append(loss.detach().clone())
    return losses


def _resumed_losses(tmp_path: Path, *, drop: tuple[str, ...] = ()) -> tuple[list, dict]:
    mgr = CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    first = _build(init_seed=0)
    losses = _train(first, HALF)
    mgr.save(first["step"], first)
    del first
    seed_everything(12345)  # a fresh process would start from other RNG states
    second = _build(init_seed=99)  # different init: the load must overwrite it
    partial = {k: v for k, v in second.items() if k not in drop}
    assert mgr.load(partial, strict=True) == HALF
    second["step"] = partial["step"]
    assert second["step"] == HALF
    return losses + _train(second, TOTAL - HALF), second


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    reference_state = _build(init_seed=0)
    reference = _train(reference_state, TOTAL)
    resumed, state = _resumed_losses(tmp_path)
    assert reference[0] > reference[-1]  # it trains
    for i, (a, b) in enumerate(zip(reference, resumed, strict=True)):
        assert torch.equal(a, b), f"step {i + 1}: {a.item()!r} != {b.item()!r}"
    for (k, a), b in zip(
        reference_state["model"].state_dict().items(), state["model"].state_dict().values()
    ):
        assert torch.equal(a, b), k


def test_resume_without_rng_or_sampler_state_diverges(tmp_path: Path) -> None:
    """Control: the exactness above depends on restoring RNG and data position."""
    reference = _train(_build(init_seed=0), TOTAL)
    for dropped in (("rng",), ("sampler",)):
        resumed, _ = _resumed_losses(tmp_path / dropped[0], drop=dropped)
        assert all(torch.equal(a, b) for a, b in zip(reference[:HALF], resumed[:HALF]))
        assert not torch.equal(reference[HALF], resumed[HALF]), dropped
