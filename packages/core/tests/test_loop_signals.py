"""GracefulShutdown: real SIGTERM/SIGUSR1 set ``requested``; peers see it via should_stop()."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from longboat.core.distributed import run_multiprocess
from longboat.core.loop.signals import GracefulShutdown


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_to_current_process_sets_requested(sig):
    before = signal.getsignal(sig)
    with GracefulShutdown() as stop:
        assert not stop.requested and not stop.should_stop()
        os.kill(os.getpid(), sig)
        assert _wait_for(lambda: stop.requested)
        assert stop.signal_name == sig.name
        assert stop.should_stop()
    assert signal.getsignal(sig) is before  # handlers restored on exit


def _child_loop(ready, result) -> None:
    with GracefulShutdown() as stop:
        ready.set()
        steps = 0
        while not stop.should_stop():
            steps += 1
            time.sleep(0.01)
        result.put((stop.signal_name, steps))  # "checkpoint" then a clean exit


# The child only sleeps and polls a flag, so forking a threaded pytest process is safe here.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_sigterm_to_subprocess_exits_cleanly():
    ctx = mp.get_context("fork")
    ready, result = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_child_loop, args=(ready, result))
    child.start()
    try:
        assert ready.wait(20)
        os.kill(child.pid, signal.SIGTERM)
        name, steps = result.get(timeout=20)
        child.join(20)
    finally:
        if child.is_alive():
            child.kill()
    assert name == "SIGTERM" and steps >= 0
    assert child.exitcode == 0  # not -15: the signal was handled, not fatal


def _peer_worker(rank: int, world_size: int) -> tuple[bool, bool, str | None]:
    with GracefulShutdown() as stop:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
            _wait_for(lambda: stop.requested)
        local = stop.requested
        return local, stop.should_stop(), stop.signal_name


@pytest.mark.multiprocess
def test_should_stop_is_all_reduced():
    out = run_multiprocess(_peer_worker, 2)
    assert out == [(False, True, "peer"), (True, True, "SIGUSR1")]


def test_second_signal_falls_through_to_previous_handler():
    calls: list[int] = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        with GracefulShutdown() as stop:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert _wait_for(lambda: stop.requested)
            assert calls == []  # the first one is ours
            os.kill(os.getpid(), signal.SIGUSR1)
            assert _wait_for(lambda: calls == [signal.SIGUSR1])
    finally:
        signal.signal(signal.SIGUSR1, original)
