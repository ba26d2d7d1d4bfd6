"""tools/bench/vlm_scaling.py at tiny shapes: Qwen2.5-VL from one HF checkpoint at LLM TP=2
(two gloo processes) with the tower on the decoder's TP and with ViT TP=1."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_testkit import run_script


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("vlm_scaling")
    out = tmp / "vlm.json"
    stdout = run_script("vlm_scaling.py", ["--tiny", "--steps", "2", "--warmup", "1", "--out",
                        str(out), "--results-dir", str(tmp)])  # fmt: skip
    return json.loads(out.read_text()), tmp, stdout


@pytest.mark.multiprocess
def test_vit_tp1_trains_the_tp2_curve(tiny_run) -> None:
    """Both phases at TP=2 from the same HF weights on the same rows: the ViT TP=1 run really
    encodes data-parallel over the TP group (its layout line says so), and its losses equal
    the plain TP=2 run's within 1e-5 (fp32 on CPU); both report tokens/s."""
    result, tmp, stdout = tiny_run
    assert result["benchmark"] == "vlm_scaling" and result["gpu"] == "cpu"
    assert result["errors"] == [] and result["skipped"] == []
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["tp2", "tp2_vit1"]
    for r in runs.values():
        assert r["gpus"] == 2 == len(r["peak_mem_gb_per_gpu"]) and len(r["losses"]) == 4
        assert r["precision"] == "fp32" and "tp=2 pp=1 dp=1" in r["describe"][0]
        for v in (r["tokens_per_s"], r["median_step_s"], *r["losses"]):
            assert math.isfinite(v) and v > 0
        assert abs(r["losses"][0] - math.log(384)) < 0.3  # random weights: near ln(vocab)
        assert len(set(r["losses"])) == 4  # four different rows
    assert "ViT tp=1" in runs["tp2_vit1"]["describe"][0]
    assert "ViT tp=1" not in runs["tp2"]["describe"][0]
    check = result["loss_check"]
    assert check["steps"] == 4 and check["equal"] and check["max_rel_loss_diff"] <= 1e-5
    ratio = runs["tp2_vit1"]["tokens_per_s"] / runs["tp2"]["tokens_per_s"]
    assert result["hetero_speedup"] == pytest.approx(ratio)
    assert result["config"]["mean_tokens"] == pytest.approx(456.0)  # both images' tokens + text
    stem = tmp / f"vlm_scaling_{result['date']}_tiny"
    assert json.loads(stem.with_suffix(".json").read_text()) == result
    assert stem.with_suffix(".md").read_text().count("| tp2_vit1 | 2 | 1 |") == 1
    assert stdout.rstrip().splitlines()[-1].startswith("ViT TP=1 + LLM TP=2 / both TP=2 tokens/s")


def test_finish_reports_the_loss_band() -> None:
    import vlm_scaling

    row = {"gpus": 2, "mfu_per_gpu": 0.2, "peak_mem_gb_per_gpu": [40.0, 40.0], "median_step_s": 1.0}
    runs = [{"name": "tp2", "tokens_per_s": 100.0, "losses": [2.0, 1.0], **row},
            {"name": "tp2_vit1", "tokens_per_s": 120.0, "losses": [2.0, 1.002], **row}]  # fmt: skip
    result = {"runs": runs, "skipped": [], "errors": []}
    vlm_scaling.finish(result)
    c = result["loss_check"]
    assert c["max_rel_loss_diff"] == pytest.approx(0.002) and not c["equal"]
    assert c["mean_rel_loss_diff"] == pytest.approx(0.001)
    assert result["hetero_speedup"] == pytest.approx(1.2) and result["hetero_faster"]
    table = vlm_scaling.table(result)
    assert "| tp2_vit1 | 2 | 1 | 0.12k | 1.200x |" in table and "NOT equal within 0.001" in table
