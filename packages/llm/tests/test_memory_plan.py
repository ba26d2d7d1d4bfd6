"""The megatron memory plan (core's ``megatron.engine.memory_plan``) on the llm stack.

- the estimator's parameter, gradient and optimizer-state bytes equal the exact bytes of the
  built tiny models (megatron DDP's grad buffer, the distributed optimizer's fp32 main
  weights and AdamW moments), with bf16 and fp32 grad buffers;
- its activation estimate is within 10% of what the tiny models save for the backward,
  counted by saved-tensor hooks (unique storages, parameters and the batch left out) with
  the longboat kernels in Triton's interpreter (the kernels the GPU runs), for recompute none
  and full, fused linear cross-entropy and megatron's logits;
- ``train.memory_budget`` on a run: a GB budget chooses recompute and the micro-batch split
  (written back, the global batch kept), auto on the CPU keeps the defaults and reports the
  plan, a pinned recompute that cannot fit is refused before work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from llm_testkit import TINY_MODEL, compose, run_interpreted

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess
from longboat.core.engine.memory.budget import GB
from longboat.core.megatron.engine.memory_plan import (
    ALLOCATOR_ALLOWANCE,
    DecoderShapes,
    OptimizerPlan,
    decoder_state_bytes,
)

FAMILIES = ("llama3", "qwen3", "qwen3_moe")  # dense; qk-norm; qk-norm + routed experts


def _state_worker(rank: int, world: int) -> dict[tuple[str, int], dict[str, int]]:
    return {(f, m): _built_state(f, m) for f in FAMILIES for m in (1, 2)}


def _built_state(family: str, microbatches: int) -> dict[str, int]:
    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.family import find_family
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.optimizer import inner_optimizers
    from longboat.llm.train.lm_step import build_train_step

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        cfg = find_family("llm", family).flavor("tiny")
        ts = build_train_step(cfg, OptimConfig(lr=1e-3), precision="bf16", device="cpu",
                              microbatches=microbatches, use_cpu_initialization=True)  # fmt: skip
        seq = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        ts.step(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())  # the moments exist now
        params = [p for c in ts.chunks for p in c.parameters()]
        out = {
            "params": sum(p.numel() for p in params),
            "weights": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params),
            "masters": 0,
            "moments": 0,
        }
        for opt in inner_optimizers(ts.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    out["masters"] += p.numel() * p.element_size()
                    state = opt.state[p]
                    out["moments"] += sum(
                        state[k].numel() * state[k].element_size()
                        for k in ("exp_avg", "exp_avg_sq")
                    )
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_state_bytes_equal_the_built_model() -> None:
    """Weights, grads (bf16 buffer at one microbatch a step, fp32 at two), fp32 main weights
    and AdamW moments of the built tiny models == the estimator's, byte for byte."""
    from longboat.core.family import find_family

    (built,) = run_multiprocess(_state_worker, 1)
    for (family, microbatches), got in built.items():
        cfg = find_family("llm", family).flavor("tiny")
        shapes = DecoderShapes.of(cfg, seq_len=16, precision="bf16")
        grad_bytes = 2 if microbatches == 1 else 4
        est = decoder_state_bytes(shapes.stage_params(), OptimizerPlan(precision="bf16"),
                                  microbatches=microbatches)  # fmt: skip
        assert shapes.stage_params() == got["params"], (family, got)
        assert est.grads == grad_bytes * got["params"]
        assert (est.weights, est.grads, est.masters, est.moments) == (
            got["weights"], got["grads"], got["masters"], got["moments"],
        ), (family, microbatches, got, est)  # fmt: skip


_SAVED_BODY = """
from longboat.llm.train.training import recompute_settings
from longboat.llm.train.loss import fused_lm_loss
b, s = 2, 16
pos = torch.arange(s).unsqueeze(0).expand(b, -1)
for family, mode, fused in (("llama3", "none", True), ("llama3", "full", True),
                            ("llama3", "none", False), ("qwen3_moe", "none", True)):
    cfg = find_family("llm", family).flavor("tiny")
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    model = build.build_model(cfg, precision="bf16", device_type="cpu", **recompute_settings(mode, None))[0]
    skip = {t.untyped_storage()._cdata for t in (*model.parameters(), tokens, pos)}
    seen = {}
    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        return t
    kw = {"output_processor": fused_lm_loss, "output_processor_context": None} if fused else {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, pos, None, labels=tokens, **kw)
    print("SAVED", family, mode, int(fused), sum(seen.values()))
"""


@pytest.mark.multiprocess
def test_activation_estimate_matches_saved_tensors(tmp_path: Path) -> None:
    """What the forward of the tiny models (2 x 16 tokens, bf16, Triton kernels in the
    interpreter) saves for the backward, within 10% of the estimate: llama3 with recompute
    none and full (fused linear cross-entropy) and none on megatron's logits path, qwen3_moe
    (qk-norm, routed experts) with none."""
    from longboat.core.family import find_family

    pytest.importorskip("triton")
    out = run_interpreted(_SAVED_BODY, tmp_path / "saved.py")
    assert len(out["SAVED"]) == 4, out
    for family, mode, fused, measured in out["SAVED"]:
        cfg = find_family("llm", family).flavor("tiny")
        shapes = DecoderShapes.of(cfg, seq_len=16, precision="bf16", fused_ce=fused == "1")
        est = shapes.layers * shapes.layer_saved(2, mode) + shapes.head_saved(2)
        if mode == "full":
            est += 4 * shapes.seq_len * shapes.head_dim  # the rotary table the layers share
        assert abs(est - int(measured)) <= 0.1 * int(measured), (family, mode, fused, est, measured)


# ----------------------------------------------------------------------------- the chooser

LLAMA3_8B = DecoderShapes(hidden=4096, ffn=14336, layers=32, heads=32, query_groups=8,
                          head_dim=128, vocab=128256, seq_len=4096)  # fmt: skip
"""Llama-3-8B's shapes at 4096 tokens a row; with 8 data-parallel ranks and micro-batch 4 its
predicted peaks are (GB): none 127.5, selective 127.4, full 65.5, full at micro-batch 2 61.5,
at 1 59.6; none at micro-batch 2 92.8, at 1 75.7."""


@pytest.mark.parametrize(
    ("budget_gb", "pinned", "expected"),
    [
        (130, None, ("none", 4)),
        (80, None, ("full", 4)),
        (62, None, ("full", 2)),
        (60, None, ("full", 1)),
        (80, "none", ("none", 1)),  # a pinned recompute: only the micro-batch splits
        (93, "selective", ("selective", 2)),
    ],
)
def test_chooser_decisions_on_recorded_budgets(
    budget_gb: float, pinned: str | None, expected: tuple[str, int]
) -> None:
    """The cheapest choice that fits: none, selective, full, then smaller micro-batches
    (the global batch kept: 4 samples a rank a step)."""
    from longboat.core.megatron.engine.memory_plan import choose_decoder_plan

    plan = choose_decoder_plan(LLAMA3_8B, OptimizerPlan(data_parallel=8), micro_batch=4,
                               accum=1, budget=budget_gb * GB, budget_source="test",
                               recompute=pinned)  # fmt: skip
    assert (plan.choice.recompute, plan.choice.micro_batch) == expected
    assert plan.estimate.total <= budget_gb * GB
    assert plan.estimate.allowance == ALLOCATOR_ALLOWANCE
    assert "allocator allowance 0.5 GB" in plan.line()


def test_chooser_refuses_what_cannot_fit_and_keeps_defaults_without_budget() -> None:
    """Nothing fits 59 GB; a pinned none at one micro-batch a step needs 127.5 GB of 80 (the
    error says so); without a budget the pinned or default levers stay and are reported."""
    from longboat.core.megatron.engine.memory_plan import choose_decoder_plan

    opt = OptimizerPlan(data_parallel=8)
    with pytest.raises(ConfigError) as err:
        choose_decoder_plan(LLAMA3_8B, opt, micro_batch=4, accum=1, budget=59 * GB,
                            budget_source="test")  # fmt: skip
    assert err.value.keys == ["train.memory_budget"]
    assert "59.0 GB" in str(err.value) and "needs 59.6 GB" in str(err.value)
    with pytest.raises(ConfigError) as err:
        choose_decoder_plan(LLAMA3_8B, opt, micro_batch=4, accum=1, budget=80 * GB,
                            budget_source="test", recompute="none",
                            micro_batch_pinned=True)  # fmt: skip
    assert "train.recompute=none" in str(err.value) and "needs 127.5 GB" in str(err.value)
    plan = choose_decoder_plan(LLAMA3_8B, opt, micro_batch=4, accum=1, budget=None,
                               budget_source="the cpu device reports no memory")  # fmt: skip
    assert (plan.choice.recompute, plan.choice.micro_batch, plan.budget) == ("none", 4, None)
    assert plan.line().startswith("Memory plan: no budget (the cpu device reports no memory)")


# ----------------------------------------------------------------------------- on a run

RUN = [
    *TINY_MODEL,
    "data=synthetic",
    "data.num_documents=48",
    "data.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "logging.progress=false",
    "logging.trackers=[]",
    "optim.moment_dtype=fp32",  # the recompute / split choices alone (test_memory_plan_moments)
]


def _plan_worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.llm.train.training import build_training

    try:
        run = build_training(compose([*RUN, *overrides]))
    except ConfigError as exc:
        return {"error": str(exc), "keys": exc.keys}
    try:
        t, plan = run.cfg.train, run.memory_plan
        return {
            "recompute": t.recompute,
            "micro": t.micro_batch_size,
            "accum": run.plan.layout.accum,
            "global": run.plan.layout.global_batch,
            "line": plan.line(),
            "total": plan.estimate.total,
            "options": {(c.recompute, c.micro_batch): e.total for c, e in plan.options},
            "peak_lines": len(run.callbacks()),
            "describe": run.describe(),
        }
    finally:
        run.close()


def _plans_worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    out = {"auto": _plan_worker(rank, world, []),
           "roomy": _plan_worker(rank, world, ["train.memory_budget=100"])}  # fmt: skip
    total = {k: v / GB for k, v in out["roomy"]["options"].items()}
    mid = (total[("none", 2)] + total[("full", 2)]) / 2
    out["full"] = _plan_worker(rank, world, [f"train.memory_budget={mid:.9f}"])
    split = (total[("full", 2)] + total[("full", 1)]) / 2
    out["small"] = _plan_worker(rank, world, [f"train.memory_budget={split:.9f}"])
    pins = ["train.recompute=none", "train.cuda_graph=true", f"train.memory_budget={split:.9f}"]
    out["pinned"] = _plan_worker(rank, world, pins)
    return out


@pytest.mark.multiprocess
def test_run_plans_to_a_gb_budget_and_reports_without_one() -> None:
    """On the CPU, auto keeps the defaults (recompute none, micro-batch 2, 2 microbatches a
    step) and reports the plan; a GB budget between the estimates of none and full at
    micro-batch 2 chooses full, one below full at 2 but above full at 1 splits the
    micro-batch (global batch 4 kept), written back into train.*; a pinned none (and one
    microbatch a step: train.cuda_graph=true) that cannot fit is refused before work."""
    ((runs),) = run_multiprocess(_plans_worker, 1)
    auto, roomy = runs["auto"], runs["roomy"]
    assert (auto["recompute"], auto["micro"], auto["accum"]) == ("none", 2, 2), auto
    assert auto["line"].startswith("Memory plan: no budget (the cpu device reports no memory")
    assert auto["line"] in auto["describe"]
    assert (roomy["recompute"], roomy["micro"]) == ("none", 2), roomy
    assert roomy["peak_lines"] == 1  # the measured-peak line (silent on the CPU)
    total = roomy["options"]
    assert set(total) == {("none", 2), ("selective", 2), ("full", 2), ("full", 1)}
    assert total[("full", 1)] < total[("full", 2)] < total[("selective", 2)] < total[("none", 2)]
    full, small, pinned = runs["full"], runs["small"], runs["pinned"]
    assert (full["recompute"], full["micro"], full["accum"]) == ("full", 2, 2), full
    assert "chose train.recompute=full" in full["line"]
    assert (small["recompute"], small["micro"], small["accum"], small["global"]) == (
        "full", 1, 4, 4), small  # fmt: skip
    assert "micro-batch 2 -> 1" in small["line"]
    assert pinned["keys"] == ["train.memory_budget"], pinned
    assert "train.recompute=none" in pinned["error"], pinned


def _sharded_params_worker(rank: int, world: int) -> dict[str, tuple[int, int]]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.family import find_family
    from longboat.core.megatron import parallel_state
    from longboat.llm.build import build_model

    out = {}
    for family, par in (("llama3", {"tensor_parallel": 2}), ("llama3", {"pipeline_parallel": 2}),
                        ("qwen3_moe", {"expert_parallel": 2})):  # fmt: skip
        layout = parallel_state.initialize(ParallelConfig(**par), get_accelerator("cpu"), seed=1)
        try:
            cfg = find_family("llm", family).flavor("tiny")
            chunks = build_model(cfg, precision="bf16", use_cpu_initialization=True)
            built = sum(p.numel() for c in chunks for p in c.parameters())
            shapes = DecoderShapes.of(cfg, seq_len=16, precision="bf16", layout=layout)
            from megatron.core import parallel_state as mps

            stage = mps.get_pipeline_model_parallel_rank()
            out[f"{family} {par}"] = (built, shapes.stage_params(stage))
        finally:
            parallel_state.destroy()
    return out


@pytest.mark.multiprocess
def test_parameter_count_per_rank_under_tensor_pipeline_and_expert_parallel() -> None:
    """Two ranks: each rank's parameters under TP 2, PP 2 (embedding on the first stage,
    final norm and output layer on the last) and EP 2 (half the experts) == the estimate."""
    for per_rank in run_multiprocess(_sharded_params_worker, 2):
        for name, (built, estimated) in per_rank.items():
            assert built == estimated, (name, built, estimated)
