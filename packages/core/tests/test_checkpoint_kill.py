"""A process SIGKILLed mid-save leaves the previous checkpoint loadable; the partial one is ignored."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from longboat.core.checkpoint import (
    TEST_PAUSE_AT_ENV,
    TEST_PAUSE_ENV,
    CheckpointManager,
    CheckpointWarning,
)
from longboat.core.config.schema import CheckpointConfig


def _model() -> nn.Module:
    # ~1.6M parameters (6 MB) plus AdamW moments: a save makes real writes.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 1024))


def _save_then_get_killed(ckpt_dir: str, pause_at: str) -> None:
    """Child process: save step 1, then start step 2 and park inside it until killed."""
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = CheckpointManager(CheckpointConfig(dir=ckpt_dir), {"run": "kill-test"})
    mgr.save(1, {"model": model, "optim": optim, "step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    os.environ[TEST_PAUSE_ENV] = "120"
    os.environ[TEST_PAUSE_AT_ENV] = pause_at
    mgr.save(2, {"model": model, "optim": optim, "step": 2})
    os._exit(3)  # unreachable unless the hook failed to pause


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("pause_at", "kill_when"),
    [
        # all shards on disk, no manifest yet: the partial folder looks most complete
        pytest.param("shards", ".metadata", id="after-shards-before-manifest"),
        pytest.param("extras", "extra_rank0.pt", id="after-extras"),
    ],
)
def test_sigkill_mid_save_keeps_previous_checkpoint(
    tmp_path: Path, pause_at: str, kill_when: str
) -> None:
    ckpt = tmp_path / "ckpt"
    # fork: the child is a real separate process (killed for real) without re-importing torch
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks")
        proc = mp.get_context("fork").Process(
            target=_save_then_get_killed, args=(str(ckpt), pause_at), daemon=True
        )
        proc.start()
    # Kill once the step-2 temp folder holds the marker file: the writer is then parked
    # in the test hook between two file groups, before any manifest exists.
    deadline = time.monotonic() + 60
    partial: list[Path] = []
    try:
        while time.monotonic() < deadline and proc.is_alive():
            partial = [p for p in ckpt.glob(".tmp-step_00000002-*") if (p / kill_when).exists()]
            if partial:
                break
            time.sleep(0.02)
        assert partial, f"the step-2 temp folder never got {kill_when} (exit {proc.exitcode})"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -signal.SIGKILL
    assert not (ckpt / "step_00000002").exists()

    mgr = CheckpointManager(CheckpointConfig(dir=str(ckpt)))
    with pytest.warns(CheckpointWarning, match=partial[0].name):
        latest = mgr.latest()
    assert latest == ckpt / "step_00000001"

    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 1024))
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3), "step": 0}
    with pytest.warns(CheckpointWarning):
        assert mgr.load(state) == 1
    assert state["step"] == 1
    for k, v in _model().state_dict().items():  # step 1 = untouched init, not the +1.0 of step 2
        assert torch.equal(model.state_dict()[k], v), k

    # the next successful save clears the leftover
    mgr.save(3, state)
    assert not list(ckpt.glob(".tmp-*"))
    assert [s for s, _ in mgr.checkpoints()] == [1, 3]
