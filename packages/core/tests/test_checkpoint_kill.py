"""A process SIGKILLed mid-save leaves the previous checkpoint loadable; the partial one is ignored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
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

# ~8 MB of weights plus AdamW moments: a save takes real writes, not one tiny file.
_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from torch import nn
    from longboat.core.checkpoint import CheckpointManager, TEST_PAUSE_AT_ENV, TEST_PAUSE_ENV
    from longboat.core.config.schema import CheckpointConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 1024))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = CheckpointManager(CheckpointConfig(dir=sys.argv[1]), {"run": "kill-test"})
    mgr.save(1, {"model": model, "optim": optim, "step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    os.environ[TEST_PAUSE_ENV] = "120"  # this save now parks at sys.argv[2] until killed
    os.environ[TEST_PAUSE_AT_ENV] = sys.argv[2]
    print("saving-2", flush=True)
    mgr.save(2, {"model": model, "optim": optim, "step": 2})
    print("UNREACHABLE", flush=True)
    """
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 1024))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("pause_at", "kill_when"),
    [
        # all shards on disk, no manifest yet: the partial folder looks most complete
        pytest.param("shards", ".metadata", id="after-shards-before-manifest"),
        pytest.param("extras", "extra_rank0.pt", id="after-extras", marks=pytest.mark.slow),
    ],
)
def test_sigkill_mid_save_keeps_previous_checkpoint(
    tmp_path: Path, pause_at: str, kill_when: str
) -> None:
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(TEST_PAUSE_ENV, None)
    env.pop(TEST_PAUSE_AT_ENV, None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, str(ckpt), pause_at],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # Kill once the temp folder of step 2 holds the marker file: the writer is then
    # parked in the test hook between two file groups, before any manifest exists.
    deadline = time.monotonic() + 60
    partial: list[Path] = []
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            partial = [p for p in ckpt.glob(".tmp-step_00000002-*") if (p / kill_when).exists()]
            if partial:
                break
            time.sleep(0.05)
        assert partial, f"the step-2 temp folder never got {kill_when} (exit {proc.poll()})"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == -signal.SIGKILL
    assert "UNREACHABLE" not in out
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
