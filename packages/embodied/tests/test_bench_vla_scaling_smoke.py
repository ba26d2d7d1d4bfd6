"""CPU smoke test of tools/bench/vla_scaling.py: GR00T-N1.6 at tiny shapes, DP=1 then DP=2
(two gloo processes, spawn), 2 timed steps each (~15-25 s on 2 shared cores, mostly the two
spawned processes importing torch + transformers); plus the pure helpers."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "tools/bench/vla_scaling.py"
pytestmark = pytest.mark.skipif(
    not SCRIPT.is_file(), reason="tools/ is not part of an installed wheel"
)


def _load_bench():
    spec = importlib.util.spec_from_file_location("vla_scaling_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    tmp = tmp_path_factory.mktemp("vla_scaling")
    out = tmp / "scaling.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--steps", "2", "--warmup", "0",
         "--embodiments", "2", "--episodes", "2", "--episode-length", "12", "16",
         "--data-dir", str(tmp / "ds"), "--out", str(out), "--results-dir", str(tmp / "res"),
         "--time-budget", "240"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text()), tmp, done.stdout


@pytest.mark.multiprocess
def test_tiny_run_dp1_and_dp2(tiny_run) -> None:
    result, tmp, stdout = tiny_run
    for key in ("benchmark", "date", "gpu", "gpus", "versions", "commit", "config", "runs",
                "dp_scaling", "checks", "skipped", "errors", "wall_s"):  # fmt: skip
        assert key in result, key
    assert result["benchmark"] == "vla_scaling" and result["gpu"] == "cpu"
    assert result["config"]["backend"] == "gloo (cpu)"
    assert result["errors"] == [] and result["skipped"] == []
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["longboat_master_dp1", "longboat_master_dp2"]
    for name, r in runs.items():
        world = 1 if name.endswith("dp1") else 2
        assert r["gpus"] == world and r["global_batch"] == 2 * world
        assert r["timed_steps"] == 2 and len(r["losses"]) == 2 and len(r["step_times_s"]) == 2
        assert len(r["peak_mem_gb_per_gpu"]) == len(r["median_step_s_per_rank"]) == world
        for v in (r["samples_per_s"], r["samples_per_s_per_gpu"], r["median_step_s"], *r["losses"]):
            assert math.isfinite(v) and v > 0, (name, v)
        # Flow-matching loss of a random-init model on min-max normalised targets: ~1-3.
        assert 0.2 < r["losses"][0] < 10.0
        assert r["steps_seen_per_rank"] == [2] * world  # the batches that reached the step
    one, two = runs["longboat_master_dp1"], runs["longboat_master_dp2"]
    # Weak scaling: total = per GPU x GPUs; the ratio is the totals'.
    assert two["samples_per_s"] == pytest.approx(2 * two["samples_per_s_per_gpu"])
    assert result["dp_scaling"]["longboat_master"] == pytest.approx(
        two["samples_per_s"] / one["samples_per_s"]
    )
    assert two["scaling_vs_dp1"] == result["dp_scaling"]["longboat_master"]
    # Each DP=2 rank read its own shard: different samples every step, rank 0 the samples
    # DP=1 read (the first micro-batch of the same order), rank 1 the next ones.
    s0, s1 = two["step0_samples_per_rank"]
    assert len(s0) == len(s1) == 2 and not set(s0) & set(s1)
    assert s0 == one["step0_samples_per_rank"][0]
    assert two["same_step_overlap"] == 0
    # Gradients were averaged: both ranks end with the same weights (exact), which differ
    # from DP=1's (another global batch).
    c0, c1 = two["params_checksum_per_rank"]
    assert c0 == c1 and c0 != one["params_checksum_per_rank"][0]
    # Step-0 loss: DP=2's (mean over ranks) is finite, within 25% of DP=1's, and not DP=1's
    # itself (rank 1's batch counts too).
    check = result["checks"]["longboat_master"]
    assert check == {
        "step0_loss_dp1": one["losses"][0],
        "step0_loss_dp2_mean_over_ranks": two["losses"][0],
        "step0_loss_rel_diff": pytest.approx(abs(two["losses"][0] / one["losses"][0] - 1)),
        "loss_in_range": True,
        "ranks_read_disjoint_shards": True,
        "ranks_params_equal": True,
        "dp2_rank0_reads_dp1_samples": True,
    }
    assert two["losses"][0] != one["losses"][0]
    # Files: JSON (= --out), markdown table, plot; the table is printed last.
    stem = tmp / "res" / f"vla_scaling_{result['date']}_tiny"
    assert json.loads(stem.with_suffix(".json").read_text()) == result
    md = stem.with_suffix(".md").read_text()
    assert md.count("| longboat_master_dp2 | 2 |") == 1
    assert stem.with_suffix(".png").stat().st_size > 0
    assert stdout.rstrip().splitlines()[-1].startswith("longboat_master: DP=2 / DP=1 samples/s")


def _run(name: str, sps: float, loss0: float, checksum: list[float], **kw) -> dict:
    world = 2 if name.endswith("dp2") else 1
    return {
        "name": name, "variant": name.rsplit("_", 1)[0], "gpus": world, "samples_per_s": sps,
        "losses": [loss0, 1.0], "same_step_overlap": 0 if world == 2 else None,
        "step0_samples_per_rank": [[0, 1], [2, 3]][:world],
        "params_checksum_per_rank": [checksum] * world, "samples_per_s_per_gpu": sps / world,
        "median_step_s": 0.1, "host_step_s": 0.01, "data_wait_s": 0.0, "mfu_per_gpu": 0.2,
        "peak_mem_gb_per_gpu": [30.0] * world, **kw,
    }  # fmt: skip


def test_finish_ratios_and_checks() -> None:
    bench = _load_bench()
    runs = [
        _run("longboat_master_dp1", 100.0, 2.0, [1.0, 2.0]),
        _run("longboat_master_dp2", 190.0, 2.2, [1.5, 2.5]),
        _run("longboat_dp1", 80.0, 2.0, [1.0, 2.0]),
        _run("longboat_dp2", 150.0, 3.0, [1.5, 2.5], same_step_overlap=1),
        {"name": "longboat_graphed_dp1", "variant": "longboat_graphed", "error": "boom"},
    ]
    runs[3]["params_checksum_per_rank"] = [[1.5, 2.5], [1.5, 2.6]]
    result = {"config": {"variants": ["longboat_master", "longboat", "longboat_graphed"]},
              "runs": runs}  # fmt: skip
    bench.finish(result)
    assert result["dp_scaling"] == {
        "longboat_master": pytest.approx(1.9), "longboat": pytest.approx(1.875)
    }  # fmt: skip
    assert runs[1]["scaling_efficiency"] == pytest.approx(0.95)
    ok, bad = result["checks"]["longboat_master"], result["checks"]["longboat"]
    assert ok["step0_loss_rel_diff"] == pytest.approx(0.1) and ok["loss_in_range"]
    assert ok["ranks_read_disjoint_shards"] and ok["ranks_params_equal"]
    assert ok["dp2_rank0_reads_dp1_samples"]
    # 50% off DP=1's loss, a sample in two ranks' batches, ranks' weights apart: all flagged.
    assert bad["step0_loss_rel_diff"] == pytest.approx(0.5) and not bad["loss_in_range"]
    assert not bad["ranks_read_disjoint_shards"] and not bad["ranks_params_equal"]
    assert "longboat_graphed" not in result["checks"]
    table = bench.table({**result, "skipped": [], "errors": []})
    assert "| longboat_graphed_dp1 | ? | boom |" in table and "1.900x" in table
    assert "OUT OF RANGE" in table


def test_same_step_overlap_and_phases() -> None:
    bench = _load_bench()
    assert bench.same_step_overlap([[[0, 1], [4, 5]], [[2, 3], [6, 7]]]) == 0
    # A sample may return on another rank in a later step (a new epoch), not in the same one.
    assert bench.same_step_overlap([[[0, 1], [4, 5]], [[2, 4], [1, 7]]]) == 0
    assert bench.same_step_overlap([[[0, 1], [4, 5]], [[1, 3], [5, 4]]]) == 3
    assert bench.phase_names(["longboat_master", "longboat"]) == [
        ("longboat_master_dp1", "longboat_master", 1),
        ("longboat_master_dp2", "longboat_master", 2),
        ("longboat_dp1", "longboat", 1),
        ("longboat_dp2", "longboat", 2),
    ]
