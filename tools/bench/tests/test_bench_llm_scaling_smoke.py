"""tools/bench/llm_scaling.py at tiny shapes: two gloo processes (spawn) run every phase."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_testkit import run_script

TP_STEPS = 4


@pytest.fixture(scope="module")
def tiny_run(
    tmp_path_factory: pytest.TempPathFactory, quickstart_dir: Path
) -> tuple[dict, Path, str]:
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("scaling")
    out = tmp / "scaling.json"
    stdout = run_script("llm_scaling.py", ["--tiny", "--steps", "2", "--warmup", "1",
                        "--tp-steps", str(TP_STEPS), "--out", str(out), "--results-dir", str(tmp),
                        "--data-dir", str(quickstart_dir)])  # fmt: skip
    return json.loads(out.read_text()), tmp, stdout


@pytest.mark.multiprocess
def test_tiny_run_writes_every_phase(tiny_run) -> None:
    result, tmp, stdout = tiny_run
    assert result["benchmark"] == "llm_scaling" and result["gpu"] == "cpu"
    assert result["errors"] == [] and result["skipped"] == []
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["dp1", "dp2", "tp1", "tp2"]
    for name in ("dp1", "dp2"):
        r = runs[name]
        assert r["gpus"] == len(r["peak_mem_gb_per_gpu"]) == (1 if name == "dp1" else 2)
        assert len(r["step_times_s"]) == 2 and len(r["losses"]) == 4
        for v in (r["tokens_per_s"], r["tokens_per_s_per_gpu"], r["median_step_s"], *r["losses"]):
            assert math.isfinite(v) and v > 0, (name, v)
    # Weak scaling: the global batch doubles; total = per GPU x GPUs; the ratio of the totals.
    dp1, dp2 = runs["dp1"], runs["dp2"]
    assert dp2["items_per_step"] == 2 * dp1["items_per_step"]
    assert dp2["tokens_per_s"] == pytest.approx(2 * dp2["tokens_per_s_per_gpu"])
    assert result["dp_scaling"] == pytest.approx(dp2["tokens_per_s"] / dp1["tokens_per_s"])
    stem = tmp / f"llm_scaling_{result['date']}_tiny"
    assert json.loads(stem.with_suffix(".json").read_text()) == result
    md = stem.with_suffix(".md").read_text()
    assert md.count("| dp2 |") == 1 and md.count("| tp2 |") == 1 and "| TP=2 vs TP=1 |" in md
    assert stem.with_suffix(".png").stat().st_size > 0
    assert stdout.rstrip().splitlines()[-1].startswith("DP=2 / DP=1 tokens/s")


@pytest.mark.multiprocess
def test_tp2_trains_the_same_curve_as_tp1(tiny_run) -> None:
    """Same HF weights, the same quickstart batches: the first loss is the same model's, and
    the curves stay together while the weights move (a TP=2 step with stale main weights or
    unreduced grads would leave them far apart)."""
    result = tiny_run[0]
    runs = {r["name"]: r for r in result["runs"]}
    tp1, tp2 = runs["tp1"]["losses"], runs["tp2"]["losses"]
    assert len(tp1) == len(tp2) == TP_STEPS == result["tp"]["steps"]
    assert all(math.isfinite(v) for v in tp1 + tp2)
    assert result["tp"]["first_step_rel_diff"] <= 1e-3
    assert abs(tp1[0] - math.log(512)) < 0.3  # random weights: near ln(vocab)
    assert result["tp"]["max_abs_loss_diff"] < 0.01
    assert tp1[-1] != tp1[0]


def test_summary_numbers_from_runs() -> None:
    import llm_scaling

    result = {
        "runs": [
            {"name": "dp1", "tokens_per_s": 100.0, "losses": [2.0, 1.0]},
            {"name": "dp2", "tokens_per_s": 190.0, "losses": [2.0, 1.5]},
            {"name": "tp1", "losses": [4.0, 3.0, 2.0]},
            {"name": "tp2", "losses": [4.0, 3.5, 2.0]},
        ],
        "tp": {},
    }
    llm_scaling.finish(result)
    assert result["dp_scaling"] == pytest.approx(1.9) and result["dp_scaling_meets_target"]
    assert result["runs"][1]["scaling_vs_dp1"] == pytest.approx(1.9)
    assert result["tp"]["max_abs_loss_diff"] == pytest.approx(0.5)
    assert result["tp"]["mean_abs_loss_diff"] == pytest.approx(0.5 / 3)
    assert result["tp"]["first_step_rel_diff"] == 0.0
