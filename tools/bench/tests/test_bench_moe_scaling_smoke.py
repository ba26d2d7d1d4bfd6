"""tools/bench/moe_scaling.py at tiny shapes: Qwen3-MoE from one HF checkpoint at EP=1 (one
gloo process) and EP=2 (two), the same global batch; plus the router comparison and the
parameter count."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_testkit import run_script


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("moe_scaling")
    out = tmp / "moe.json"
    stdout = run_script("moe_scaling.py", ["--tiny", "--steps", "2", "--warmup", "1", "--out",
                        str(out), "--results-dir", str(tmp)])  # fmt: skip
    return json.loads(out.read_text()), tmp, stdout


@pytest.mark.multiprocess
def test_ep2_routes_and_trains_as_ep1(tiny_run) -> None:
    """Same weights, same two rows a step: every MoE layer sends each row's tokens to the same
    experts at EP=2 as at EP=1 (counts equal, the load-balancing loss within 1e-5), and the
    loss curves agree (fp32 on CPU); one GPU at one row a step routes row 0 alike."""
    result, tmp, stdout = tiny_run
    assert result["benchmark"] == "moe_scaling" and result["gpu"] == "cpu"
    assert result["errors"] == [] and result["skipped"] == []
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["ep1", "ep2", "ep1_gbs1"]
    for name, world, rows in (("ep1", 1, 2), ("ep2", 2, 2), ("ep1_gbs1", 1, 1)):
        r = runs[name]
        assert r["gpus"] == world == len(r["peak_mem_gb_per_gpu"])
        assert r["items_per_step"] == rows * 64 and len(r["losses"]) == 4
        for v in (r["tokens_per_s"], r["median_step_s"], *r["losses"]):
            assert math.isfinite(v) and v > 0, (name, v)
        assert abs(r["losses"][0] - math.log(256)) < 0.3  # random weights: near ln(vocab)
    one, two, single = runs["ep1"]["router"], runs["ep2"]["router"], runs["ep1_gbs1"]["router"]
    assert sorted(one) == sorted(two) == ["1", "2"]
    for layer in one:
        a, b = one[layer], two[layer]
        assert len(a["tokens_per_expert"]) == len(b["tokens_per_expert"]) == 2
        for row in a["tokens_per_expert"]:
            assert len(row) == 4 and sum(row) == 64 * 2  # 64 tokens x top-2
        assert a["tokens_per_expert"] == b["tokens_per_expert"]
        assert a["tokens_per_expert"][0] != a["tokens_per_expert"][1]  # two different rows
        for x, y in zip(a["load_balancing_loss"], b["load_balancing_loss"], strict=True):
            assert 0.5 < x < 4.0 and y == pytest.approx(x, rel=1e-5)
        assert single[layer]["tokens_per_expert"] == a["tokens_per_expert"][:1]
    check = result["router_check"]
    assert check["equal"] and all(v["counts_identical"] for v in check["layers"].values())
    assert result["max_abs_loss_diff"] < 1e-5
    assert runs["ep1"]["losses"][-1] != runs["ep1"]["losses"][0]
    best = max(runs["ep1"]["tokens_per_s"], runs["ep1_gbs1"]["tokens_per_s"])
    assert result["ep_scaling"] == pytest.approx(runs["ep2"]["tokens_per_s"] / best)
    stem = tmp / f"moe_scaling_{result['date']}_tiny"
    assert json.loads(stem.with_suffix(".json").read_text()) == result
    md = stem.with_suffix(".md").read_text()
    assert md.count("| ep2 | 2 | 2 |") == 1 and "| MoE layer (step 0) |" in md
    assert stem.with_suffix(".png").stat().st_size > 0
    assert stdout.rstrip().splitlines()[-1].startswith("EP=2 / one GPU")


def test_router_comparison_flags_moved_tokens() -> None:
    import moe_scaling

    one = {"1": {"tokens_per_expert": [[3, 1], [2, 2]], "load_balancing_loss": [1.0, 1.2]}}
    same = moe_scaling.compare_router(one, json.loads(json.dumps(one)), topk=1)
    assert same["equal"] and same["layers"]["1"]["assignments_differing"] == 0.0
    moved = {"1": {"tokens_per_expert": [[2, 2], [2, 2]], "load_balancing_loss": [1.0, 1.2]}}
    v = moe_scaling.compare_router(one, moved, topk=1)
    # One of 8 token-to-expert assignments moved.
    assert not v["equal"] and v["layers"]["1"]["assignments_differing"] == pytest.approx(1 / 8)
    aux = {"1": {"tokens_per_expert": [[3, 1], [2, 2]], "load_balancing_loss": [1.0, 1.21]}}
    v = moe_scaling.compare_router(one, aux, topk=1)
    assert not v["equal"] and v["layers"]["1"]["load_balancing_loss_max_rel_diff"] == pytest.approx(
        0.01 / 1.2
    )
    short = {"1": {"tokens_per_expert": [[3, 1]], "load_balancing_loss": [1.0]}}
    assert "error" in moe_scaling.compare_router(one, short, topk=1)["layers"]["1"]


def test_param_counts_match_transformers() -> None:
    """The FLOP count's parameters: the tiny shape's total equals HF Qwen3MoeForCausalLM's;
    the active ones leave out all but top-k experts per layer."""
    import moe_scaling
    import torch
    from baselines import llm_reference as ref
    from bench_train import compose
    from transformers import Qwen3MoeForCausalLM

    from longboat.core.family import find_family

    c = moe_scaling.TINY
    m = compose("llm", "quickstart", moe_scaling.overrides(c, 1, 1, None), "unused").model
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(find_family("llm", "qwen3_moe").to_hf_config(m))
    total, active = ref.param_counts(m)
    assert total == sum(p.numel() for p in hf.parameters())
    expert = 3 * c["hidden"] * c["moe_ffn"]
    assert total - active == c["layers"] * (c["experts"] - c["topk"]) * expert
    full = compose("llm", "quickstart", moe_scaling.overrides(moe_scaling.FULL, 1, 1, None), "u")
    # 30B-A3B's 4 layers: 2 x 151936 x 2048 embeddings + 4 x (attention 18.9M, 128 experts of
    # 4.7M, router, norms); active: 8 experts a layer.
    assert ref.param_counts(full.model) == (3_114_814_464, 849_890_304)
