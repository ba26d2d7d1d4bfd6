"""tools/bench/vla_scaling.py at tiny shapes: GR00T-N1.6 at DP=1 then DP=2 (two gloo
processes), 2 timed steps each; plus the pure helpers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_testkit import run_script


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    tmp = tmp_path_factory.mktemp("vla_scaling")
    out = tmp / "scaling.json"
    stdout = run_script("vla_scaling.py", ["--tiny", "--steps", "2", "--warmup", "1",
                        "--embodiments", "2", "--episodes", "2", "--episode-length", "12", "16",
                        "--data-dir", str(tmp / "ds"), "--out", str(out), "--results-dir",
                        str(tmp / "res"), "--time-budget", "240"])  # fmt: skip
    return json.loads(out.read_text()), tmp, stdout


@pytest.mark.multiprocess
def test_tiny_run_dp1_and_dp2(tiny_run) -> None:
    result, tmp, stdout = tiny_run
    assert result["benchmark"] == "vla_scaling" and result["gpu"] == "cpu"
    assert result["errors"] == [] and result["skipped"] == []
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["longboat_master_dp1", "longboat_master_dp2"]
    for name, r in runs.items():
        world = 1 if name.endswith("dp1") else 2
        assert r["gpus"] == world and r["global_batch"] == 2 * world
        assert r["timed_steps"] == len(r["step_times_s"]) == 2 and len(r["losses"]) == 4
        assert len(r["peak_mem_gb_per_gpu"]) == len(r["median_step_s_per_rank"]) == world
        for v in (r["samples_per_s"], r["samples_per_s_per_gpu"], r["median_step_s"], *r["losses"]):
            assert math.isfinite(v) and v > 0, (name, v)
        assert 0.2 < r["losses"][0] < 10.0  # flow-matching loss of a random-init model
    one, two = runs["longboat_master_dp1"], runs["longboat_master_dp2"]
    assert two["samples_per_s"] == pytest.approx(2 * two["samples_per_s_per_gpu"])
    assert result["dp_scaling"]["longboat_master"] == pytest.approx(
        two["samples_per_s"] / one["samples_per_s"]
    )
    # Each DP=2 rank read its own shard, rank 0 the samples DP=1 read first.
    s0, s1 = two["step0_samples_per_rank"]
    assert len(s0) == len(s1) == 2 and not set(s0) & set(s1)
    assert s0 == one["step0_samples_per_rank"][0] and two["same_step_overlap"] == 0
    # Gradients were averaged: both ranks end with the same weights (exact), which differ
    # from DP=1's (another global batch).
    c0, c1 = two["params_checksum_per_rank"]
    assert c0 == c1 and c0 != one["params_checksum_per_rank"][0]
    check = result["checks"]["longboat_master"]
    assert check["loss_in_range"] and check["ranks_read_disjoint_shards"]
    assert check["ranks_params_equal"] and check["dp2_rank0_reads_dp1_samples"]
    assert check["step0_loss_rel_diff"] == pytest.approx(
        abs(two["losses"][0] / one["losses"][0] - 1)
    )
    assert two["losses"][0] != one["losses"][0]  # rank 1's batch counts too
    stem = tmp / "res" / f"vla_scaling_{result['date']}_tiny"
    assert json.loads(stem.with_suffix(".json").read_text()) == result
    assert stem.with_suffix(".md").read_text().count("| longboat_master_dp2 | 2 |") == 1
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
    import vla_scaling

    runs = [
        _run("longboat_master_dp1", 100.0, 2.0, [1.0, 2.0]),
        _run("longboat_master_dp2", 190.0, 2.2, [1.5, 2.5]),
        _run("longboat_dp1", 80.0, 2.0, [1.0, 2.0]),
        _run("longboat_dp2", 150.0, 3.0, [1.5, 2.5], same_step_overlap=1),
        {"name": "longboat_graphed_dp1", "gpus": 1, "error": "boom"},
    ]
    runs[3]["params_checksum_per_rank"] = [[1.5, 2.5], [1.5, 2.6]]
    result = {"config": {"variants": ["longboat_master", "longboat", "longboat_graphed"]},
              "runs": runs, "skipped": [], "errors": []}  # fmt: skip
    vla_scaling.finish(result)
    assert result["dp_scaling"] == {
        "longboat_master": pytest.approx(1.9),
        "longboat": pytest.approx(1.875),
    }
    assert runs[1]["scaling_efficiency"] == pytest.approx(0.95)
    ok, bad = result["checks"]["longboat_master"], result["checks"]["longboat"]
    assert ok["step0_loss_rel_diff"] == pytest.approx(0.1) and ok["loss_in_range"]
    assert ok["ranks_read_disjoint_shards"] and ok["ranks_params_equal"]
    # 50% off DP=1's loss, a sample in two ranks' batches, ranks' weights apart: all flagged.
    assert bad["step0_loss_rel_diff"] == pytest.approx(0.5) and not bad["loss_in_range"]
    assert not bad["ranks_read_disjoint_shards"] and not bad["ranks_params_equal"]
    assert "longboat_graphed" not in result["checks"]
    table = vla_scaling.table(result)
    assert "| longboat_graphed_dp1 | failed: boom |" in table and "1.900x" in table
    assert "OUT OF RANGE" in table


def test_same_step_overlap_and_phases() -> None:
    import vla_scaling

    assert vla_scaling.same_step_overlap([[[0, 1], [4, 5]], [[2, 3], [6, 7]]]) == 0
    # A sample may return on another rank in a later step (a new epoch), not in the same one.
    assert vla_scaling.same_step_overlap([[[0, 1], [4, 5]], [[2, 4], [1, 7]]]) == 0
    assert vla_scaling.same_step_overlap([[[0, 1], [4, 5]], [[1, 3], [5, 4]]]) == 3
    assert vla_scaling.phases(["longboat_master", "longboat"]) == [
        ("longboat_master_dp1", 1), ("longboat_master_dp2", 2), ("longboat_dp1", 1),
        ("longboat_dp2", 2),
    ]  # fmt: skip
