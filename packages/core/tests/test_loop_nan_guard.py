"""NaNGuard: skip and count, abort after N in a row, reset on finite, state round trip."""

from __future__ import annotations

import math

import pytest
import torch

from longboat.core.config.schema import NaNGuardConfig
from longboat.core.distributed import run_multiprocess
from longboat.core.loop.nan_guard import DeferredNaNGuard, NaNGuard, NonFiniteLossError


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


class _Event:
    """Records when it is recorded and waited on (the order the deferred guard relies on)."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def record(self) -> None:
        self.log.append(f"record {self.name}")

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")


class _Accelerator:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.made = 0

    def event(self) -> _Event:
        self.made += 1
        return _Event(self.log, f"e{self.made}")


def _stream(values):
    return [(torch.tensor(loss), torch.tensor(norm)) for loss, norm in values]


def test_deferred_guard_resolves_the_previous_step_only():
    acc = _Accelerator()
    deferred = DeferredNaNGuard(NaNGuard(NaNGuardConfig(max_consecutive=3)), acc)
    deferred.submit(0, torch.tensor(1.0), torch.tensor(2.0))
    assert deferred.resolve(keep=1) == [] and deferred.reads == 0  # nothing waited on
    deferred.submit(1, torch.tensor(float("nan")), torch.tensor(2.0))
    (v0,) = deferred.resolve(keep=1)
    assert (v0.step, v0.loss, v0.grad_norm, v0.stepped) == (0, 1.0, 2.0, True)
    # Step 1 is queued behind step 0: only step 0's event was waited on.
    assert acc.log == ["record e1", "record e2", "wait e1"]
    assert deferred.pending == [1]
    (v1,) = deferred.resolve()
    assert v1.step == 1 and not v1.stepped and math.isnan(v1.loss)
    assert acc.log[-1] == "wait e2" and deferred.pending == [] and deferred.reads == 2
    assert deferred.guard.state_dict() == {"consecutive": 1, "total_skipped": 1}


def test_deferred_guard_counts_like_check_and_aborts_one_step_later():
    nan, inf = float("nan"), float("inf")
    values = [(1.0, 1.0), (nan, nan), (2.0, inf), (1.0, 1.0), (inf, 3.0), (nan, 1.0), (1.0, 1.0)]
    sync = NaNGuard(NaNGuardConfig(max_consecutive=3))
    expected = [sync.check(loss, norm) for loss, norm in _stream(values)]
    deferred = DeferredNaNGuard(NaNGuard(NaNGuardConfig(max_consecutive=3)), _Accelerator())
    got = []
    for i, (loss, norm) in enumerate(_stream(values)):
        deferred.submit(i, loss, norm)
        got += [v.stepped for v in deferred.resolve(keep=1)]
        assert len(got) == i  # always exactly the previous step resolved
    got += [v.stepped for v in deferred.resolve()]
    assert got == expected == [True, False, False, True, False, False, True]
    assert (
        deferred.guard.state_dict() == sync.state_dict() == {"consecutive": 0, "total_skipped": 4}
    )

    # Three in a row: check() raises at step index 3, the deferred guard while resolving
    # it, i.e. after step 4 was submitted (one step later), naming the step.
    bad = [(1.0, 1.0), (nan, 1.0), (nan, nan), (inf, 1.0), (1.0, 1.0)]
    sync = NaNGuard(NaNGuardConfig(max_consecutive=3))
    with pytest.raises(NonFiniteLossError) as sync_err:
        for loss, norm in _stream(bad):
            sync.check(loss, norm)
    deferred = DeferredNaNGuard(NaNGuard(NaNGuardConfig(max_consecutive=3)), _Accelerator())
    submitted = []
    with pytest.raises(NonFiniteLossError) as lag_err:
        for i, (loss, norm) in enumerate(_stream(bad)):
            deferred.submit(i, loss, norm)
            submitted.append(i)
            deferred.resolve(keep=1)
    assert submitted == [0, 1, 2, 3, 4]
    msg = str(lag_err.value)
    assert msg.startswith("3 consecutive steps") and "loss=inf, grad_norm=1.0 at step 4;" in msg
    assert "train.nan_guard.max_consecutive=3" in msg and "3 skipped in total" in msg
    assert msg.replace(" at step 4", "") == str(sync_err.value)


def test_deferred_guard_disabled_and_without_accelerator():
    deferred = DeferredNaNGuard(NaNGuard(NaNGuardConfig(enabled=False, max_consecutive=1)))
    for i in range(3):
        deferred.submit(i, torch.tensor(float("nan")), torch.tensor(float("nan")))
    assert [v.stepped for v in deferred.resolve()] == [True, True, True]
    assert deferred.guard.total_skipped == 0


def test_host_reads_records_every_value_read_with_its_caller() -> None:
    from longboat.core.loop import HostReads

    x = torch.tensor([1.5, 2.0])
    step = {"n": 0}
    with HostReads(tag=lambda: step["n"]) as mode:
        y = x * 2  # no read
        step["n"] = 1
        float(y[0])
        y.tolist()
        step["n"] = 2
        bool(y.sum() > 0)
    assert [(t, name) for t, name, _ in mode.reads] == [
        (1, "__float__"), (1, "tolist"), (2, "__bool__")
    ]  # fmt: skip
    assert all(where.startswith("test_loop_nan_guard.py ") for _, _, where in mode.reads)
