"""A synthetic dataset is the same bytes every time a process writes it, also between training
runs: two runs of one config then train on the same pixels (the lagged-guard and resume tests
compare runs bit for bit). x264's SIMD paths broke this inside a training process: 2-3%
of the tiny GR00T runs wrote videos that decoded to other pixels."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from embodied_testkit import tiny_run_overrides

from longboat.core.config.compose import compose_experiment
from longboat.embodied.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")


def _digest(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha1(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


@pytest.mark.slow
def test_datasets_written_between_training_runs_are_the_same_bytes(tmp_path: Path) -> None:
    # 120 runs: at the 2-3% rate of differing writes without the fix, all 120 equal by chance
    # has p < 9%; measured without it: 3 different byte streams (118, 1, 1).
    seen: dict[str, int] = {}
    for _ in range(120):
        out = tmp_path / "run"
        shutil.rmtree(out, ignore_errors=True)
        cfg = compose_experiment("groot_n1_6_tiny", tiny_run_overrides(out), world_size=1)
        train(cfg)
        key = str(sorted(_digest(out / "dataset" / "videos").items()))
        seen[key] = seen.get(key, 0) + 1
    assert len(seen) == 1, (
        f"the dataset's videos came out {len(seen)} ways: {sorted(seen.values())}"
    )
