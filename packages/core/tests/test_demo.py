"""The core demo: it learns, checkpoints, stops cleanly on SIGTERM and resumes exactly."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from longboat.core.checkpoint import read_manifest
from longboat.core.config.compose import compose_experiment
from longboat.core.demo import run
from longboat.core.distributed import run_multiprocess


def _cfg(tmp_path: Path, *extra: str):
    return compose_experiment(
        "demo",
        [
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"logging.dir={tmp_path / 'logs'}",
            "logging.progress=false",
            "logging.trackers=[]",
            *extra,
        ],
        stack="core",
    )


def _mse(result, step: int) -> float:
    """The held-out MSE a run measured at ``step``."""
    return result.eval[step]["eval_mse"]


def test_demo_learns_checkpoints_and_resumes(tmp_path: Path) -> None:
    first = run(_cfg(tmp_path, "train.steps=60", "checkpoint.every_steps=20"))
    assert (first.start_step, first.end_step, first.resumed_from) == (0, 60, None)
    assert len(first.losses) == 60
    # 60 steps of 64 samples: held-out MSE falls below 25% of the untrained model's
    assert _mse(first, 60) < 0.25 * _mse(first, 0)
    head, tail = sum(first.losses[:10]) / 10, sum(first.losses[-10:]) / 10
    assert tail < 0.3 * head
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ckpts == ["step_00000040", "step_00000060"]  # every 20, keep_last=2
    rows = [json.loads(line) for line in first.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, *range(5, 61, 5)]  # step 0: the held-out MSE
    assert {"loss", "lr", "grad_norm", "skipped_steps", "eval_mse"} <= rows[-1].keys()

    again = run(_cfg(tmp_path, "train.steps=90", "checkpoint.every_steps=20"))
    assert again.resumed_from == tmp_path / "ckpt" / "step_00000060"
    assert (again.start_step, again.end_step) == (60, 90)
    assert _mse(again, 60) == _mse(first, 60)  # the resumed weights are the saved ones
    assert _mse(again, 90) <= _mse(first, 60)
    rows = [json.loads(line) for line in again.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows][-3:] == [80, 85, 90]


def test_demo_sigterm_saves_and_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    full = run(_cfg(tmp_path / "full", "train.steps=30"))

    def sigterm_at_12(step: int) -> None:
        if step == 12:
            os.kill(os.getpid(), signal.SIGTERM)

    stopped = run(_cfg(tmp_path / "split", "train.steps=30"), on_step=sigterm_at_12)
    assert stopped.stopped_by_signal == "SIGTERM"
    assert stopped.end_step == 12
    assert stopped.checkpoint == tmp_path / "split" / "ckpt" / "step_00000012"

    resumed = run(_cfg(tmp_path / "split", "train.steps=30"))
    assert resumed.start_step == 12 and resumed.end_step == 30
    assert stopped.losses + resumed.losses == full.losses  # exact float equality
    assert _mse(resumed, 30) == _mse(full, 30)


def _demo_rank(rank: int, world: int, root: str) -> tuple[int, list[float], float]:
    result = run(_cfg(Path(root), "train.steps=12"))
    return result.end_step, result.losses, _mse(result, 12)


@pytest.mark.multiprocess
def test_demo_under_ddp_at_world_2_resumes_at_world_1(tmp_path: Path) -> None:
    (end0, losses0, eval0), (end1, losses1, eval1) = run_multiprocess(
        _demo_rank, 2, str(tmp_path), timeout=120
    )
    assert end0 == end1 == 12
    assert losses0 != losses1  # each rank trains on its own shard of every batch
    # ...yet DDP's averaged gradients keep the replicas identical: same held-out MSE.
    assert eval0 == eval1
    assert read_manifest(tmp_path / "ckpt" / "step_00000012").world_size == 2
    resumed = run(_cfg(tmp_path, "train.steps=20"))
    assert resumed.resumed_from == tmp_path / "ckpt" / "step_00000012"
    assert (resumed.start_step, resumed.end_step) == (12, 20)
