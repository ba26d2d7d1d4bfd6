"""Ctrl-C while a checkpoint is being written: nothing lost.

One Ctrl-C during a periodic save lets the save finish and stops the run after it (exit 130);
a second one (the user insists) interrupts the save: its partial folder is never taken and the
previous checkpoint stays the latest. Either way the resumed run continues the uninterrupted
run's losses exactly.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from longboat.core.checkpoint import TEST_PAUSE_AT_ENV, TEST_PAUSE_ENV
from longboat.core.config.compose import compose_experiment
from longboat.core.demo import run

STEPS = ("train.steps=24", "checkpoint.every_steps=10", "checkpoint.keep_last=0")


def _cfg(out: Path):
    overrides = [f"output_dir={out}", "logging.progress=false", "logging.trackers=[]"]
    return compose_experiment("demo", [*overrides, *STEPS], stack="core")


def _ctrl_c_during_save(ckpt_dir: Path, step: int, times: int) -> threading.Thread:
    """Send ``times`` SIGINTs (0.05 s apart) while the save of ``step`` holds its shards in the
    temp folder."""

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any((p / ".metadata").exists() for p in ckpt_dir.glob(f".tmp-step_{step:08d}-*")):
                for _ in range(times):
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.05)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def full_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The uninterrupted run's per-step losses."""
    return run(_cfg(tmp_path_factory.mktemp("full"))).losses


@pytest.fixture
def paused_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save pauses 1.5 s once its shards are written, before its manifest."""
    monkeypatch.setenv(TEST_PAUSE_ENV, "1.5")
    monkeypatch.setenv(TEST_PAUSE_AT_ENV, "shards")


@pytest.fixture
def long_paused_saves(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every save pauses 5 s once its shards are written (room for both SIGINTs inside the
    save on a busy machine, where the watcher thread may wake late), and SIGINT raises
    KeyboardInterrupt as in a terminal: a process started in the background of a
    non-interactive shell inherits SIGINT ignored, and Python then installs no handler."""
    monkeypatch.setenv(TEST_PAUSE_ENV, "5")
    monkeypatch.setenv(TEST_PAUSE_AT_ENV, "shards")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_save_finishes_it_then_stops(
    tmp_path: Path, paused_saves: None, full_losses: list[float]
) -> None:
    out = tmp_path / "split"
    watcher = _ctrl_c_during_save(out / "checkpoints", 10, times=1)
    stopped = run(_cfg(out))
    watcher.join(timeout=5)
    assert (stopped.stopped_by_signal, stopped.end_step, stopped.exit_code) == ("SIGINT", 10, 130)
    assert stopped.checkpoint == out / "checkpoints" / "step_00000010"
    assert not list((out / "checkpoints").glob(".tmp-*"))
    resumed = run(_cfg(out))
    assert resumed.start_step == 10
    assert stopped.losses + resumed.losses == full_losses  # exact


def test_a_second_ctrl_c_interrupts_the_save_and_keeps_the_previous_checkpoint(
    tmp_path: Path, long_paused_saves: None, full_losses: list[float]
) -> None:
    out = tmp_path / "split"
    watcher = _ctrl_c_during_save(out / "checkpoints", 20, times=2)
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(out))
    watcher.join(timeout=5)
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["step_00000010"]  # the interrupted step-20 folder is gone, not taken
    resumed = run(_cfg(out))
    assert resumed.start_step == 10
    assert resumed.losses == full_losses[10:]  # steps 11..24, bit for bit
