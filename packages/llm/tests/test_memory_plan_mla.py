"""The memory plan of the DeepSeek-V3 family (core's ``megatron.engine.latent_shapes``):

- parameters per rank equal the built megatron model's (tiny flavors, with multi-token
  prediction, under tensor, pipeline and expert parallelism), the family's own count, and
  transformers' ``DeepseekV3ForCausalLM`` / ``DeepseekV32ForCausalLM`` on the meta device at
  the released sizes (which have no multi-token prediction layer); the weight, grad and
  optimizer-state bytes equal the built train step's;
- the activation estimate is within 10% of what the tiny models save for the backward
  (saved-tensor hooks; longboat kernels in Triton's interpreter, where DeepSeek-V3.2's sparse
  attention takes the ``longboat.kernels.dsa`` path that CUDA runs) for recompute none,
  selective and full, dense MLA with and without a q latent, sparse MLA, MTP;
- the chooser's decisions at the benchmark shape ``v32_32k`` on recorded budgets (the DSA
  kernels' chunks as the planner counts them), and a
  DeepSeek-V3 run that plans to a GB budget (choosing recompute) instead of reporting
  "Memory plan: none".
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from llm_testkit import compose, run_interpreted

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess
from longboat.core.engine.memory.budget import GB
from longboat.core.megatron.engine.latent_shapes import DSA_CHUNK_ELEMENTS, LatentDecoderShapes
from longboat.core.megatron.engine.memory_plan import OptimizerPlan, decoder_state_bytes

_V32_WIDE = {"kv_lora_rank": 20, "v_head_dim": 12, "index_topk": 5}
"""v32_tiny with the latent, value and query/key widths all different (no coincidence of
widths hides a wrong term) and fewer keys than tokens."""
_NO_Q_LATENT = {"q_lora_rank": None, "moe_router_num_groups": 1, "num_shared_experts": 2,
                "moe_ffn_hidden_size": 48, "ffn_hidden_size": 96, "moe_topk": 3}  # fmt: skip
"""tiny as Moonlight builds it: one q projection, no expert groups, two shared experts."""


def _flavor(name: str, **changes: Any) -> Any:
    from longboat.core.family import find_family

    return replace(find_family("llm", "deepseek_v3").flavor(name), **changes)


# ----------------------------------------------------------------------------- parameters


def _built_worker(rank: int, world: int) -> dict[str, Any]:
    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.optimizer import inner_optimizers
    from longboat.llm.build import build_model
    from longboat.llm.train.lm_step import build_train_step

    out: dict[str, Any] = {}
    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        for name, cfg in (("tiny", _flavor("tiny")), ("v32_tiny", _flavor("v32_tiny")),
                          ("tiny mtp", _flavor("tiny", mtp_num_layers=1)),
                          ("no q latent", _flavor("tiny", **_NO_Q_LATENT))):  # fmt: skip
            chunks = build_model(cfg, precision="bf16", use_cpu_initialization=True)
            out[name] = sum(p.numel() for c in chunks for p in c.parameters())
        cfg = _flavor("tiny")
        ts = build_train_step(cfg, OptimConfig(lr=1e-3), precision="bf16", device="cpu",
                              microbatches=1, use_cpu_initialization=True)  # fmt: skip
        seq = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        ts.step(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())  # the moments exist now
        params = [p for c in ts.chunks for p in c.parameters()]
        state = {"weights": sum(p.numel() * p.element_size() for p in params),
                 "grads": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params),
                 "masters": 0, "moments": 0}  # fmt: skip
        for opt in inner_optimizers(ts.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    state["masters"] += p.numel() * p.element_size()
                    state["moments"] += sum(opt.state[p][k].numel() * opt.state[p][k].element_size()
                                            for k in ("exp_avg", "exp_avg_sq"))  # fmt: skip
        out["state"] = state
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_parameters_and_state_bytes_equal_the_built_model() -> None:
    """Parameters of the built tiny models (dense + MoE layers, router, shared experts, MLA
    with and without a q latent, the lightning indexer, an MTP depth) == the estimate == the
    family's count; the train step's weights, bf16 grads, fp32 main weights and moments ==
    the estimate's bytes."""
    from longboat.llm.models.deepseek_v3.flops import param_counts

    (built,) = run_multiprocess(_built_worker, 1)
    cases = {"tiny": _flavor("tiny"), "v32_tiny": _flavor("v32_tiny"),
             "tiny mtp": _flavor("tiny", mtp_num_layers=1),
             "no q latent": _flavor("tiny", **_NO_Q_LATENT)}  # fmt: skip
    for name, cfg in cases.items():
        shapes = LatentDecoderShapes.of(cfg, seq_len=16, precision="bf16")
        assert shapes.stage_params() == built[name] == param_counts(cfg)[0], (name, built)
    shapes = LatentDecoderShapes.of(cases["tiny"], seq_len=16, precision="bf16")
    est = decoder_state_bytes(shapes.stage_params(), OptimizerPlan(precision="bf16"),
                              microbatches=1)  # fmt: skip
    got = built["state"]
    assert (est.weights, est.grads, est.masters, est.moments) == (
        got["weights"], got["grads"], got["masters"], got["moments"]), (got, est)  # fmt: skip
    assert est.grads == 2 * built["tiny"]  # one microbatch a step: bf16 grads


def _sharded_worker(rank: int, world: int) -> dict[str, tuple[int, int]]:
    from megatron.core import parallel_state as mps

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.llm.build import build_model

    out = {}
    for name, cfg, par in (
        ("tiny tp2", _flavor("tiny"), {"tensor_parallel": 2}),
        ("tiny 4 layers + mtp pp2", _flavor("tiny", num_layers=4, mtp_num_layers=1),
         {"pipeline_parallel": 2}),
        ("v32_tiny ep2", _flavor("v32_tiny"), {"expert_parallel": 2}),
    ):  # fmt: skip
        layout = parallel_state.initialize(ParallelConfig(**par), get_accelerator("cpu"), seed=1)
        try:
            chunks = build_model(cfg, precision="bf16", use_cpu_initialization=True)
            built = sum(p.numel() for c in chunks for p in c.parameters())
            shapes = LatentDecoderShapes.of(cfg, seq_len=16, precision="bf16", layout=layout)
            out[name] = (built, shapes.stage_params(mps.get_pipeline_model_parallel_rank()))
        finally:
            parallel_state.destroy()
    return out


@pytest.mark.multiprocess
def test_parameters_per_rank_under_tensor_pipeline_and_expert_parallel() -> None:
    """Two ranks: TP 2 (MLA's down and up projections, the output projection, the dense and
    shared SwiGLUs split), PP 2 (the dense layer on the first stage; the MTP depth, its
    embedding copy, the final norm and output layer on the last), EP 2 (half the routed
    experts; the indexer whole) == the estimate on every rank."""
    for per_rank in run_multiprocess(_sharded_worker, 2):
        for name, (built, estimated) in per_rank.items():
            assert built == estimated, (name, built, estimated)


def test_released_sizes_equal_family_count_and_transformers() -> None:
    """Moonlight-16B-A3B, DeepSeek-V3 (671B) and DeepSeek-V3.2 (its indexer): the estimate
    == the family's count == transformers' model on the meta device plus the MTP depths
    (transformers builds none); Kimi K2 against the family's count."""
    from transformers import AutoModelForCausalLM

    from longboat.llm.models.deepseek_v3.flops import param_counts
    from longboat.llm.models.deepseek_v3.hf_config import to_hf_config

    for flavor in ("moonlight_16b_a3b", "671b", "v32", "kimi_k2"):
        cfg = _flavor(flavor)
        shapes = LatentDecoderShapes.of(cfg, seq_len=4096, precision="bf16")
        assert shapes.stage_params() == param_counts(cfg)[0], flavor
        if flavor == "kimi_k2":
            continue
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(to_hf_config(cfg))
        hf_params = sum(p.numel() for p in hf.parameters())
        assert shapes.stage_params() == hf_params + cfg.mtp_num_layers * shapes.mtp_params(), (
            flavor, hf_params)  # fmt: skip
    assert LatentDecoderShapes.of(_flavor("671b"), seq_len=1, precision="bf16").stage_params() == (
        682_636_472_320)  # 671.0B + one 11.6B MTP depth  # fmt: skip


# ----------------------------------------------------------------------------- activations

_SAVED_BODY = """
import json
from dataclasses import replace
from longboat.llm.train.training import recompute_settings
from longboat.llm.train.loss import fused_lm_loss
b, s = 2, 16
pos = torch.arange(s).unsqueeze(0).expand(b, -1)
for name, flavor, changes, mode in json.loads(sys.argv[1]):
    cfg = replace(find_family("llm", "deepseek_v3").flavor(flavor), **changes)
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    model = build.build_model(cfg, precision="bf16", device_type="cpu",
                              **recompute_settings(mode, None))[0]
    skip = {t.untyped_storage()._cdata
            for t in (*model.parameters(), *model.buffers(), tokens, pos)}
    seen, alive = {}, []
    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in skip and key not in seen:
            alive.append(t)  # held, so that no later storage reuses the address
            seen[key] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, pos, None, labels=tokens, output_processor=fused_lm_loss,
              output_processor_context=None)
    print("SAVED", name, mode, sum(seen.values()))
"""

_CASES = [
    ("mtp", "tiny", {"mtp_num_layers": 1}, "none"),
    ("mtp", "tiny", {"mtp_num_layers": 1}, "selective"),
    ("mtp", "tiny", {"mtp_num_layers": 1}, "full"),
    ("no_q_latent", "tiny", _NO_Q_LATENT, "none"),
    ("sparse", "v32_tiny", _V32_WIDE, "none"),
    ("sparse", "v32_tiny", _V32_WIDE, "selective"),
    ("sparse", "v32_tiny", _V32_WIDE, "full"),
]


@pytest.mark.multiprocess
def test_activation_estimate_matches_saved_tensors(tmp_path: Path) -> None:
    """What the forward of the tiny models (2 x 16 tokens, bf16, Triton kernels in the
    interpreter) saves for the backward, within 10% of the estimate: dense MLA with a q
    latent and an MTP depth (recompute none, selective, full), without a q latent (none),
    DeepSeek-V3.2's sparse attention on ``longboat.kernels.dsa`` (none, selective, full)."""
    import json

    pytest.importorskip("triton")
    out = run_interpreted(_SAVED_BODY, tmp_path / "saved.py", json.dumps(_CASES), timeout=600)
    assert len(out["SAVED"]) == len(_CASES), out
    by_case = {(n, f, m): c for n, f, c, m in _CASES}
    for name, mode, measured in out["SAVED"]:
        flavor = next(f for n, f, _c, m in _CASES if n == name and m == mode)
        cfg = _flavor(flavor, **by_case[(name, flavor, mode)])
        shapes = LatentDecoderShapes.of(cfg, seq_len=16, precision="bf16")
        est = shapes.stage_saved(0, 2, mode, shapes.layers) + shapes.head_saved(2)
        assert abs(est - int(measured)) <= 0.1 * int(measured), (name, mode, est, measured)


# ----------------------------------------------------------------------------- the chooser


def _v32_32k(**changes: Any) -> LatentDecoderShapes:
    """The llm benchmark's ``v32_32k``: DeepSeek-V3.2 cut to its first (dense) layer, no MTP,
    32,768 tokens a sample."""
    cfg = _flavor("v32", num_layers=1, first_k_dense=1, mtp_num_layers=0, **changes)
    return LatentDecoderShapes.of(cfg, seq_len=32768, precision="bf16")


@pytest.mark.parametrize(
    ("budget_gb", "expected"),
    [(80, "none"), (70.8, "none"), (61, None)],
)
def test_chooser_decisions_at_v32_32k(budget_gb: float, expected: str | None) -> None:
    """At micro-batch 1 the predicted peaks (GB) are none 61.8, selective 61.8 (its smaller
    activations come back in the backward beside the kernel's gradients) and full 62.2 (one
    layer: full recompute brings the whole layer back in the backward): 80 GB and 70.8 GB
    (``auto`` on an 80 GB card: 90% of its free memory) keep none, 61 GB is refused with the
    numbers."""
    from longboat.core.megatron.engine.memory_plan import choose_decoder_plan

    shapes, opt = _v32_32k(), OptimizerPlan(precision="bf16")
    if expected is None:
        with pytest.raises(ConfigError) as err:
            choose_decoder_plan(shapes, opt, micro_batch=1, accum=1, budget=budget_gb * GB,
                                budget_source="test")  # fmt: skip
        assert "train.recompute=none at micro-batch 1, needs 61.8 GB" in str(err.value)
        return
    plan = choose_decoder_plan(shapes, opt, micro_batch=1, accum=1, budget=budget_gb * GB,
                               budget_source="test")  # fmt: skip
    assert (plan.choice.recompute, plan.choice.micro_batch) == (expected, 1)
    totals = {c.recompute: round(e.total / GB, 1) for c, e in plan.options}
    assert totals == {"none": 61.8, "selective": 61.8, "full": 62.2}


def test_sparse_attention_saves_more_than_dense_mla_at_32k() -> None:
    """At 32K tokens the sparse path (absorbed query at the latent width, its output and the
    copy the value up projection reads) saves more per layer than dense MLA (flash attention
    at the query/key width), and its backward's fp32 gradients are the larger working set."""
    sparse, dense = _v32_32k(), _v32_32k(index_topk=None)
    for mode in ("none", "selective"):
        assert sparse.layer_saved(1, mode, dense=True) > dense.layer_saved(1, mode, dense=True)
    assert sparse.backward_workspace(1, "none") > dense.backward_workspace(1, "none")
    # the indexer scores one chunk of queries at a time: 512 MiB of fp32, not 4 GiB
    scores = 4 * DSA_CHUNK_ELEMENTS
    assert scores <= sparse.indexer_transient(1) < scores + 2 * GB


def test_planned_chunks_are_the_kernels() -> None:
    """The planner's chunk of the DSA kernels (core does not import the kernels) is theirs."""
    from longboat.kernels import dsa

    assert DSA_CHUNK_ELEMENTS == dsa.CHUNK_ELEMENTS


# ----------------------------------------------------------------------------- on a run

RUN = [
    "model=deepseek_v3_tiny",
    "data=synthetic",
    "data.num_documents=48",
    "data.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "logging.progress=false",
    "logging.trackers=[]",
]


def _plan_worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.llm.train.training import build_training

    run = build_training(compose([*RUN, *overrides]))
    try:
        plan = run.memory_plan
        if isinstance(plan, str):
            return {"line": plan, "recompute": run.cfg.train.recompute}
        return {
            "line": plan.line(),
            "recompute": run.cfg.train.recompute,
            "options": {(c.recompute, c.micro_batch): e.total for c, e in plan.options},
        }
    finally:
        run.close()


def _runs_worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    out = {"roomy": _plan_worker(rank, world, ["train.memory_budget=100"])}
    total = {k: v / GB for k, v in out["roomy"]["options"].items()}
    mid = (total[("none", 2)] + total[("full", 2)]) / 2
    out["full"] = _plan_worker(rank, world, [f"train.memory_budget={mid:.9f}"])
    out["kl"] = _plan_worker(rank, world, ["model.index_topk=8", "model.index_loss_coeff=0.1",
                                           "train.memory_budget=100"])  # fmt: skip
    return out


@pytest.mark.multiprocess
def test_deepseek_run_plans_to_a_gb_budget() -> None:
    """A DeepSeek-V3 run is planned like Qwen3's: a roomy budget keeps recompute none, one
    between the estimates of none and full chooses full (written back into train.recompute);
    only an indexer trained by its KL loss, which the estimate does not describe, reports
    "Memory plan: none"."""
    ((runs),) = run_multiprocess(_runs_worker, 1)
    roomy, full, kl = runs["roomy"], runs["full"], runs["kl"]
    assert roomy["recompute"] == "none" and roomy["line"].startswith("Memory plan:"), roomy
    total = roomy["options"]
    assert total[("full", 2)] < total[("selective", 2)] < total[("none", 2)], total
    assert full["recompute"] == "full" and "chose train.recompute=full" in full["line"], full
    assert kl["line"].startswith("Memory plan: none (the estimate does not cover the sparse")
    assert kl["recompute"] == "none"
