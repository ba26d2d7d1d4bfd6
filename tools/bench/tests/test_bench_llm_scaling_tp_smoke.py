"""tools/bench/llm_scaling.py's TP phases on the Qwen3-1.7B shape (``--tp-shape qwen3_1_7b``,
tiny: qk-norm, tied embeddings), two gloo processes for TP=2, judged against a noise band
file in llm_loss_alignment's format; plus the band's bookkeeping."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_testkit import run_script

TP_STEPS = 4
BAND_REF = [6.0, 5.9, 5.8, 5.7, 5.6, 5.5]
BAND_PERTURBED = [6.0, 5.91, 5.79, 5.72, 5.6, 5.5]
"""The band over the first 4 steps: |diff| 0, 0.01, 0.01, 0.02 (max 0.02, mean 0.01)."""


def _band_file(path: Path, **config_changes: object) -> Path:
    """An llm_loss_alignment result of the tiny qwen3_1_7b shape at seed 0."""
    import llm_loss_alignment as la

    config = {**la.shape(True, name="qwen3_1_7b"), "seed": 0, "steps": len(BAND_REF)}
    band = {"benchmark": "llm_loss_alignment", "date": "2026-12-01", "commit": "abc1234",
            "config": {**config, **config_changes},
            "runs": [{"name": "reference", "losses": BAND_REF},
                     {"name": "reference_perturbed", "losses": BAND_PERTURBED},
                     {"name": "longboat", "losses": BAND_REF}]}  # fmt: skip
    path.write_text(json.dumps(band))
    return path


@pytest.fixture(scope="module")
def tiny_run(
    tmp_path_factory: pytest.TempPathFactory, quickstart_dir: Path
) -> tuple[dict, Path, str]:
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("scaling_tp")
    band = _band_file(tmp / "band.json")
    stdout = run_script("llm_scaling.py", ["--tiny", "--phases", "tp", "--tp-shape", "qwen3_1_7b",
                        "--tp-steps", str(TP_STEPS), "--tp-band", str(band), "--results-dir",
                        str(tmp), "--data-dir", str(quickstart_dir)])  # fmt: skip
    (path,) = tmp.glob("llm_scaling_tp_qwen3_1_7b_*_tiny.json")
    return json.loads(path.read_text()), tmp, stdout


@pytest.mark.multiprocess
def test_qwen3_tp2_trains_tp1s_curve_inside_the_band(tiny_run) -> None:
    """Same HF Qwen3 weights (tied embeddings), same batches: TP=2's curve is TP=1's (fp32 on
    CPU: within 1e-4 while the weights move), judged against the band file's first 4 steps;
    both runs report tokens/s."""
    result, tmp, stdout = tiny_run
    assert result["errors"] == [] and result["skipped"] == []
    assert result["config"]["phases"] == ["tp"] and result["config"]["tp_shape"]["tie"] == 1
    assert result["config"]["tp_shape"]["family"] == "qwen3"
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["tp1", "tp2"]
    tp1, tp2 = runs["tp1"]["losses"], runs["tp2"]["losses"]
    assert len(tp1) == len(tp2) == TP_STEPS == result["tp"]["steps"]
    # Random weights give about ln(vocab); with tied embeddings the input token's own logit is
    # ~init_std * hidden above the others (0.02 * 64 = 1.28 here), so runs of one token in the
    # quickstart text (indentation in its source files) lower the first loss by up to that.
    assert math.log(512) - 1.3 < tp1[0] < math.log(512) + 0.3
    assert tp1[-1] != tp1[0]
    assert result["tp"]["first_step_rel_diff"] <= 1e-5
    assert result["tp"]["max_abs_loss_diff"] < 1e-4
    for name, world in (("tp1", 1), ("tp2", 2)):
        r = runs[name]
        assert r["gpus"] == world == len(r["peak_mem_gb_per_gpu"])
        assert r["timed_steps"] == TP_STEPS - 2 and r["items_per_step"] == 2 * 64
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
    ratio = runs["tp2"]["tokens_per_s"] / runs["tp1"]["tokens_per_s"]
    assert result["tp"]["tp2_vs_tp1_tokens_per_s"] == pytest.approx(ratio)
    v = result["tp"]["verdict"]
    assert v["band_max_diff"] == pytest.approx(0.02) and v["band_mean_diff"] == pytest.approx(0.01)
    assert v["max_diff"] == pytest.approx(result["tp"]["max_abs_loss_diff"]) and v["passes"]
    md = (tmp / f"llm_scaling_tp_qwen3_1_7b_{result['date']}_tiny.md").read_text()
    assert md.count("| tp2 | 2 |") == 1 and "band max 2.00e-02, mean 1.00e-02: inside" in md
    assert stdout.rstrip().splitlines()[-1].startswith("TP=2 / TP=1 tokens/s (qwen3_1_7b)")


def test_band_of_another_run_is_not_applied(tmp_path: Path) -> None:
    import llm_loss_alignment as la
    import llm_scaling

    c = la.shape(True, name="qwen3_1_7b")
    ok = llm_scaling.band_curves(_band_file(tmp_path / "a.json"), c, seed=0)
    assert ok["reference"] == BAND_REF and ok["reference_perturbed"] == BAND_PERTURBED
    other = llm_scaling.band_curves(_band_file(tmp_path / "b.json", micro_batch=4), c, seed=1)
    assert "micro_batch=4 (TP phases: 2)" in other["error"] and "seed=0" in other["error"]
    assert "reference" not in other
    llama = llm_scaling.band_curves(_band_file(tmp_path / "c.json"), la.shape(True), seed=0)
    assert "family=qwen3 (TP phases: llama3)" in llama["error"]


def test_finish_judges_tp_against_the_band() -> None:
    import llm_scaling

    band = {"reference": BAND_REF, "reference_perturbed": BAND_PERTURBED}
    runs = [{"name": "tp1", "tokens_per_s": 100.0, "losses": [6.0, 5.9, 5.8, 5.7]},
            {"name": "tp2", "tokens_per_s": 150.0, "losses": [6.0, 5.9, 5.85, 5.7]}]  # fmt: skip
    result = {"runs": runs, "tp": {"band": band}}
    llm_scaling.finish(result)
    v = result["tp"]["verdict"]
    # 0.05 > 1.5 x the band's 0.02 at step 2: outside.
    assert v["max_diff"] == pytest.approx(0.05) and not v["within_max"] and not v["passes"]
    assert result["tp"]["tp2_vs_tp1_tokens_per_s"] == pytest.approx(1.5)
    short = {"runs": runs, "tp": {"band": {"reference": BAND_REF[:3],
                                           "reference_perturbed": BAND_PERTURBED[:3]}}}  # fmt: skip
    llm_scaling.finish(short)
    assert "verdict" not in short["tp"] and "3 steps" in short["tp"]["band"]["error"]
