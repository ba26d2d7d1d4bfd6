"""tools/bench/vla_scaling.py's FSDP2 variant at tiny shapes: GR00T-N1.6 with
``parallel.strategy=fsdp`` at DP=1, then DP=2 (two gloo processes), 2 timed steps each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_testkit import run_script


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("vla_scaling_fsdp")
    out = tmp / "scaling.json"
    run_script("vla_scaling.py", ["--tiny", "--variants", "longboat_fsdp", "--steps", "2",
               "--warmup", "1", "--embodiments", "2", "--episodes", "2", "--episode-length", "12",
               "16", "--data-dir", str(tmp / "ds"), "--out", str(out), "--results-dir",
               str(tmp / "res"), "--time-budget", "240"])  # fmt: skip
    return json.loads(out.read_text()), tmp


@pytest.mark.multiprocess
def test_fsdp_dp2_shards_and_keeps_the_ranks_equal(tiny_run) -> None:
    """FSDP2 at two ranks: the trained parameters are DTensors (none at one process, where the
    strategy leaves the model unwrapped), each rank reads its own shard of the batch, and the
    gathered weights are equal on both ranks after the run, apart from DP=1's."""
    result, tmp = tiny_run
    assert result["errors"] == [] and result["skipped"] == []
    assert result["config"]["variant_keys"] == {"longboat_fsdp": ["parallel.strategy=fsdp"]}
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["longboat_fsdp_dp1", "longboat_fsdp_dp2"]
    one, two = runs["longboat_fsdp_dp1"], runs["longboat_fsdp_dp2"]
    assert one["strategy"] == two["strategy"] == "fsdp"
    assert one["sharded_params_per_rank"] == [0]
    s0, s1 = two["sharded_params_per_rank"]
    assert s0 == s1 > 10
    for r in (one, two):
        assert r["timed_steps"] == 2 and len(r["losses"]) == 4
        for v in (r["samples_per_s"], r["median_step_s"], *r["losses"]):
            assert math.isfinite(v) and v > 0
    assert two["global_batch"] == 2 * one["global_batch"] == 4
    c0, c1 = two["params_checksum_per_rank"]
    assert c0 == c1 and c0 != one["params_checksum_per_rank"][0]
    check = result["checks"]["longboat_fsdp"]
    assert check["loss_in_range"] and check["ranks_read_disjoint_shards"]
    assert check["ranks_params_equal"] and check["dp2_rank0_reads_dp1_samples"]
    ratio = two["samples_per_s"] / one["samples_per_s"]
    assert result["dp_scaling"]["longboat_fsdp"] == pytest.approx(ratio)
    assert result["dp_scaling_meets_target"]["longboat_fsdp"] == (ratio >= 1.9)
    stem = tmp / "res" / f"vla_scaling_{result['date']}_fsdp_tiny"
    assert json.loads(stem.with_suffix(".json").read_text()) == result
    assert "longboat_fsdp: DP=2 / DP=1 samples/s" in stem.with_suffix(".md").read_text()


def test_results_name_the_variants_unless_default() -> None:
    import vla_scaling

    assert vla_scaling.variants_tag(["longboat", "longboat_fsdp"], tiny=False) == ""
    assert vla_scaling.variants_tag(["longboat_master"], tiny=True) == "_tiny"
    assert vla_scaling.variants_tag(["longboat_fsdp"], tiny=True) == "_fsdp_tiny"
    tag = vla_scaling.variants_tag(["longboat_graphed", "longboat_master", "longboat"], tiny=False)
    assert tag == "_graphed_master_default"
