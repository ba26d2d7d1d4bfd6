"""tools/bench/diffusion_scaling.py at tiny shapes: a Wan from one diffusers checkpoint trained by
longboat-diffusion train on one process and at context parallel 2 (two gloo processes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_testkit import run_script

# A large constant LR, so the steps after the first train visibly moved weights: equal curves
# then need equal gradients, not only an equal first forward.
KEYS = ["optim.lr=0.01", "optim.schedule.warmup_steps=0"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    pytest.importorskip("megatron.core")
    pytest.importorskip("diffusers")
    tmp = tmp_path_factory.mktemp("diffusion_scaling")
    out = tmp / "scaling.json"
    stdout = run_script("diffusion_scaling.py", ["--tiny", "--steps", "2", "--warmup", "1",
                        "--out", str(out), "--results-dir", str(tmp), "--keys", *KEYS])  # fmt: skip
    return json.loads(out.read_text()), tmp, stdout


@pytest.mark.multiprocess
def test_cp2_trains_the_one_process_curve(tiny_run) -> None:
    """Both phases from the same diffusers weights on the same samples: the CP=2 run really
    splits the tokens over two ranks (its layout line says cp=2), both ranks report the same
    losses, and the curve equals the one-process run's within 1e-5 (fp32 on CPU) while the
    large LR moves it; both report tokens/s."""
    result, tmp, stdout = tiny_run
    assert result["benchmark"] == "diffusion_scaling" and result["gpu"] == "cpu"
    assert result["errors"] == [] and result["skipped"] == []
    assert (
        result["config"]["video_tokens"] == 18 and result["config"]["frames"] == 9
    )  # 3x4x6 / 1x2x2
    assert not result["config"]["cli_defaults"]
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["cp1", "cp2"]
    for name, world in (("cp1", 1), ("cp2", 2)):
        r = runs[name]
        assert r["gpus"] == world == r["context_parallel"] == len(r["peak_mem_gb_per_gpu"])
        assert r["precision"] == "fp32" and f"cp={world} dp=1" in r["describe"][0]
        assert r["timed_steps"] == 2 and len(r["losses"]) == 4 and r["losses_per_rank_equal"]
        for v in (r["tokens_per_s"], r["samples_per_s"], r["median_step_s"], *r["losses"]):
            assert math.isfinite(v) and v > 0
    assert len(set(runs["cp1"]["losses"])) == 4
    check = result["loss_check"]
    assert check["steps"] == 4 and check["equal"] and check["max_rel_loss_diff"] <= 1e-5
    ratio = runs["cp2"]["tokens_per_s"] / runs["cp1"]["tokens_per_s"]
    assert result["cp2_speedup"] == pytest.approx(ratio)
    stem = tmp / f"diffusion_scaling_{result['date']}_tiny"
    assert json.loads(stem.with_suffix(".json").read_text()) == result
    assert stem.with_suffix(".md").read_text().count("| cp2 | 2 | 2 |") == 1
    assert stdout.rstrip().splitlines()[-1].startswith("CP=2 on two GPUs / one GPU tokens/s")


def test_finish_reports_the_loss_band_and_target() -> None:
    import diffusion_scaling

    row = {"gpus": 2, "context_parallel": 2, "mfu_per_gpu": 0.2, "peak_mem_gb_per_gpu": [40.0],
           "median_step_s": 1.0, "samples_per_s": 1.0}  # fmt: skip
    runs = [{"name": "cp1", "tokens_per_s": 100.0, "losses": [2.0, 1.0], **row},
            {"name": "cp2", "tokens_per_s": 160.0, "losses": [2.0, 1.002], **row}]  # fmt: skip
    result = {"runs": runs, "skipped": [], "errors": []}
    diffusion_scaling.finish(result)
    c = result["loss_check"]
    assert c["max_rel_loss_diff"] == pytest.approx(0.002) and not c["equal"]
    assert c["mean_rel_loss_diff"] == pytest.approx(0.001)
    assert result["cp2_speedup"] == pytest.approx(1.6) and not result["meets_target"]
    table = diffusion_scaling.table(result)
    assert "| cp2 | 2 | 2 | 0.16k | 1.000 | 1.600x |" in table and "NOT equal within 0.001" in table
