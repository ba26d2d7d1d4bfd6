"""CPU smoke test of tools/bench/llm_scaling.py: tiny shapes, 2 gloo processes (spawn).

The script's real run is DP=2 vs DP=1 and TP=2 vs TP=1 on two H200s; on CPU it runs every
phase at llm_throughput's tiny shapes (~15-25 s on 2 shared cores, mostly two spawned
processes importing torch + megatron + transformers).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "tools/bench/llm_scaling.py"
TP_STEPS = 6


def _load_bench():
    spec = importlib.util.spec_from_file_location("llm_scaling_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, float, str]:
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("scaling")
    out = tmp / "scaling.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--steps", "3", "--warmup", "1",
         "--tp-steps", str(TP_STEPS), "--out", str(out), "--results-dir", str(tmp)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text()), tmp, wall, done.stdout


@pytest.mark.multiprocess
def test_tiny_run_writes_every_phase(tiny_run) -> None:
    result, tmp, wall, stdout = tiny_run
    for key in ("benchmark", "date", "gpu", "versions", "commit", "config", "runs", "tp",
                "dp_scaling", "tp1_losses", "tp2_losses", "max_abs_loss_diff", "wall_s"):  # fmt: skip
        assert key in result, key
    assert result["benchmark"] == "llm_scaling" and result["gpu"] == "cpu"
    assert result["errors"] == [] and result["skipped"] == []
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["dp1", "dp2", "dp2_no_overlap", "dp2_overlap_param_gather"]
    for name, r in runs.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["gpus"] == (1 if name == "dp1" else 2)
        assert len(r["peak_mem_gb_per_gpu"]) == r["gpus"]
        assert len(r["step_times_s"]) == 3 and len(r["losses"]) == 4
        for v in (r["tokens_per_s"], r["tokens_per_s_per_gpu"], r["median_step_s"], *r["losses"]):
            assert math.isfinite(v) and v > 0, (name, v)
    # Weak scaling: total = per-GPU x GPUs; the scaling factor is total over dp1's.
    dp1, dp2 = runs["dp1"], runs["dp2"]
    assert dp2["tokens_per_s"] == pytest.approx(2 * dp2["tokens_per_s_per_gpu"])
    assert result["dp_scaling"] == pytest.approx(dp2["tokens_per_s"] / dp1["tokens_per_s"])
    ddp = {name: r["notes"]["ddp"] for name, r in runs.items()}
    assert ddp["dp2"]["overlap_grad_reduce"] and not ddp["dp2_no_overlap"]["overlap_grad_reduce"]
    assert ddp["dp2_overlap_param_gather"]["overlap_param_gather"]
    # Overlapping the reductions changes when they run, not what they compute: the three DP=2
    # runs (same init, same per-rank batches) train the same losses (bit-identical on CPU).
    for name in ("dp2_no_overlap", "dp2_overlap_param_gather"):
        assert runs[name]["max_abs_loss_diff_vs_dp2"] <= 1e-5, name
    # Files: JSON (= --out), the markdown table, the plot; the table is printed last.
    stem = tmp / f"llm_scaling_{result['date']}"
    assert json.loads(stem.with_suffix(".json").read_text()) == result
    md = stem.with_suffix(".md").read_text()
    assert md.count("| dp2 |") == 1 and "| TP=2 vs TP=1 |" in md
    assert stem.with_suffix(".png").stat().st_size > 0
    assert stdout.rstrip().splitlines()[-1].startswith("DP=2 / DP=1 tokens/s")
    print(f"tiny llm_scaling wall {wall:.1f}s (script's own clock {result['wall_s']:.1f}s)")


@pytest.mark.multiprocess
def test_tp2_trains_the_same_curve_as_tp1(tiny_run) -> None:
    result = tiny_run[0]
    tp1, tp2 = result["tp1_losses"], result["tp2_losses"]
    assert len(tp1) == len(tp2) == TP_STEPS == result["tp"]["steps"]
    assert all(math.isfinite(v) for v in tp1 + tp2)
    # Same HF weights, same batch: the first loss is the same model's (TP=2 reorders the
    # bf16 reductions and takes megatron's vocab-parallel CE instead of the fused one).
    assert abs(tp2[0] - tp1[0]) <= 1e-3 * abs(tp1[0]), (tp1[0], tp2[0])
    assert result["tp"]["first_step_rel_diff"] <= 1e-3
    # The HF weights are random: the first loss sits near ln(vocab).
    assert abs(tp1[0] - math.log(256)) < 0.3
    # And the curves stay together while the weights move (a TP=2 step that used stale main
    # weights or unreduced grads would leave them apart by far more).
    assert result["tp"]["max_abs_loss_diff"] < 0.01
    assert max(abs(a - b) for a, b in zip(tp1, tp2, strict=True)) == result["max_abs_loss_diff"]


def test_summary_numbers_from_runs() -> None:
    bench = _load_bench()
    result = {
        "runs": [
            {"name": "dp1", "tokens_per_s": 100.0, "losses": [2.0, 1.0]},
            {"name": "dp2", "tokens_per_s": 190.0, "losses": [2.0, 1.5]},
            {"name": "dp2_no_overlap", "tokens_per_s": 180.0, "losses": [2.0, 1.25]},
            {"name": "dp2_overlap_param_gather", "error": "boom"},
        ],
        "tp": {},
        "tp1_losses": [4.0, 3.0, 2.0],
        "tp2_losses": [4.0, 3.5, 2.0],
    }
    bench.finish(result, None, time.time())
    dp2, no_overlap = result["runs"][1], result["runs"][2]
    assert result["dp_scaling"] == pytest.approx(1.9) and result["dp_scaling_meets_target"]
    assert no_overlap["scaling_vs_dp1"] == pytest.approx(1.8)
    assert no_overlap["max_abs_loss_diff_vs_dp2"] == pytest.approx(0.25)
    assert "max_abs_loss_diff_vs_dp2" not in dp2
    assert result["tp"]["max_abs_loss_diff"] == pytest.approx(0.5)
    assert result["tp"]["mean_abs_loss_diff"] == pytest.approx(0.5 / 3)
    assert result["tp"]["first_step_rel_diff"] == 0.0
