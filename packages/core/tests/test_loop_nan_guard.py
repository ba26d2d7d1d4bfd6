"""NaNGuard: skip and count, abort after N in a row, reset on finite, state round trip."""

from __future__ import annotations

import math

import pytest
import torch

from longboat.core.config.schema import NaNGuardConfig
from longboat.core.distributed import run_multiprocess
from longboat.core.loop.nan_guard import NaNGuard, NonFiniteLossError


def test_skip_count_and_reset():
    guard = NaNGuard(NaNGuardConfig(max_consecutive=3))
    assert guard.check(torch.tensor(1.0), grad_norm=torch.tensor(2.0))
    assert not guard.check(torch.tensor(float("nan")))
    assert not guard.check(torch.tensor(1.0), grad_norm=torch.tensor(float("inf")))
    assert (guard.consecutive, guard.total_skipped) == (2, 2)
    assert guard.check(0.5)  # a finite step resets the run
    assert (guard.consecutive, guard.total_skipped) == (0, 2)
    assert not guard.check(math.inf)
    assert not guard.check(-math.inf)
    assert (guard.consecutive, guard.total_skipped) == (2, 4)


def test_abort_after_max_consecutive_names_key():
    guard = NaNGuard(NaNGuardConfig(max_consecutive=3))
    assert not guard.check(float("nan"))
    assert not guard.check(float("nan"))
    with pytest.raises(NonFiniteLossError) as info:
        guard.check(torch.tensor(float("nan")), grad_norm=torch.tensor(3.0))
    msg = str(info.value)
    assert msg.startswith("3 consecutive steps")
    assert "train.nan_guard.max_consecutive=3" in msg and "loss=nan" in msg


def test_disabled_always_steps():
    guard = NaNGuard(NaNGuardConfig(enabled=False, max_consecutive=1))
    assert all(guard.check(float("nan")) for _ in range(5))
    assert guard.total_skipped == 0


def test_state_dict_round_trip_continues_count():
    guard = NaNGuard(NaNGuardConfig(max_consecutive=3))
    guard.check(float("nan"))
    guard.check(float("nan"))
    state = guard.state_dict()
    assert state == {"consecutive": 2, "total_skipped": 2}
    resumed = NaNGuard(NaNGuardConfig(max_consecutive=3))
    resumed.load_state_dict(state)
    with pytest.raises(NonFiniteLossError, match="3 consecutive"):
        resumed.check(float("nan"))


def test_invalid_max_consecutive():
    with pytest.raises(ValueError, match=r"train\.nan_guard\.max_consecutive=0"):
        NaNGuard(NaNGuardConfig(max_consecutive=0))


def _sync_worker(rank: int, world_size: int) -> tuple[bool, bool]:
    guard = NaNGuard(NaNGuardConfig(max_consecutive=5))
    first = guard.check(torch.tensor(float("nan") if rank == 1 else 1.0))
    second = guard.check(torch.tensor(1.0))
    return first, second


@pytest.mark.multiprocess
def test_ranks_skip_together():
    # Only rank 1 sees NaN, yet every rank must skip that step (or DDP replicas diverge).
    assert run_multiprocess(_sync_worker, 2) == [(False, True), (False, True)]
