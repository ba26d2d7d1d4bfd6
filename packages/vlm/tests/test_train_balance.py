"""DP load balancing of packed rows (``vlm.dp_balance``).

Dealing a step's rows by cost changes who computes what, not the global batch: DP=2 with
balancing trains the same per-step losses as DP=1 over the same global batches. The row
costs follow the packed samples (quadratic in each sample's length, plus the ViT's images).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from longboat.core.distributed import run_multiprocess


def _overrides(out: Path, data: Path, world: int) -> list[str]:
    return [
        f"output_dir={out}",
        f"data.out_dir={data}",
        "data.num_train=40",
        "data.num_eval=4",
        "data.questions_per_image=null",  # one or two turns: rows of different costs
        "data.seq_len=256",
        "train.steps=3",
        "train.global_batch_size=4",
        "train.eval_every=0",
        "train.log_every=1",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.every_steps=0",
        "checkpoint.save_on_exit=false",
        "export.enabled=false",
        "vlm.answer_eval_samples=0",
        f"parallel.data_parallel={world}",
    ]


def _worker(rank: int, world: int, overrides: list[str]) -> dict:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import Trainer, typed_config
    from longboat.vlm.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="vlm"))
    training = build_training(cfg)
    try:
        moved = 0
        if training.row_costs is not None:
            for step in range(20):
                plain = training.plan.assignment(step, balanced=False)
                dealt = training.plan.assignment(step)
                moved += plain.ranks != dealt.ranks
                assert max(dealt.costs) <= max(plain.costs) + 1e-6
        run = Trainer(cfg, training).fit()
        return {"losses": run.losses, "moved": moved, "describe": training.describe()}
    finally:
        training.close()


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_balanced_dp2_trains_the_dp1_losses(tmp_path: Path) -> None:
    data = tmp_path / "data"
    one = run_multiprocess(_worker, 1, _overrides(tmp_path / "dp1", data, 1), timeout=400)[0]
    two = run_multiprocess(_worker, 2, _overrides(tmp_path / "dp2", data, 2), timeout=400)
    assert two[0]["moved"] > 0, "the test data must give the balancer rows to move"
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=0, atol=1e-5)
    assert two[0]["losses"] == two[1]["losses"]
    assert any(line.startswith("DP balancing: max/mean rank cost") for line in two[0]["describe"])


def test_row_costs_grow_with_sample_length_and_images() -> None:
    from types import SimpleNamespace

    from longboat.core.data.balance import balance
    from longboat.core.data.packing import Piece
    from longboat.vlm.models.qwen2_5_vl.model import flavor
    from longboat.vlm.train.balance import cost_models, row_costs

    cfg = flavor("tiny")
    none = np.zeros((0, 3), np.int64)
    samples = [
        SimpleNamespace(image_grid_thw=none, video_grid_thw=none),
        SimpleNamespace(image_grid_thw=np.array([[1, 8, 8]]), video_grid_thw=none),
    ]
    rows = [
        [Piece(0, 0, 200)],  # one long text sample
        [Piece(0, 0, 100), Piece(0, 100, 200)],  # the same tokens as two samples
        [Piece(1, 0, 100), Piece(0, 0, 100)],  # one with an image
    ]
    ds = SimpleNamespace(rows=rows, samples=samples, seq_len=256)
    costs = row_costs(ds, cfg)
    decoder, vision = cost_models(cfg)
    # Same tokens: the single sample costs more by the attention term only.
    np.testing.assert_allclose(costs[0] - costs[1], decoder.quadratic * (200**2 - 2 * 100**2))
    np.testing.assert_allclose(costs[2] - costs[1], vision.cost([64]))
    dealt = balance(np.array([10.0, 1.0, 1.0])[[0, 1, 2, 0]], 2, per_rank=2)
    assert sorted(len(r) for r in dealt.ranks) == [2, 2]
    assert max(dealt.costs) == 11.0  # each rank gets one of the two 10s


def _losses(out: Path) -> list[float]:
    """The per-step losses of the run in ``out`` (its metrics file)."""
    import json

    rows = [json.loads(x) for x in next(out.glob("logs/*/metrics.jsonl")).read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_loader_workers_give_the_main_process_rows(tmp_path: Path) -> None:
    """Rows built ahead by loader processes (``data.num_workers``) train the same steps as
    rows built on the training thread. Both ``longboat-vlm train experiment=quickstart`` runs
    in one fresh process (its loader workers are that process's children)."""
    from vlm_testkit import run_cli_commands

    data = tmp_path / "data"
    outs = {workers: tmp_path / f"w{workers}" for workers in (0, 2)}
    run_cli_commands([
        ["train", "experiment=quickstart", *_overrides(out, data, 1), f"data.num_workers={w}"]
        for w, out in outs.items()
    ], timeout=400)  # fmt: skip
    runs = {workers: _losses(out) for workers, out in outs.items()}
    assert len(runs[0]) == 3
    assert runs[2] == runs[0]
