"""bf16 optimizer moments in the megatron memory plan (core's ``megatron.engine.memory_plan``
with ``engine.moments``): the estimator counts them exactly, the chooser takes them only
where no recompute or micro-batch split fits (core's order, as the torch engine's plan) and
says that they change numerics, and a run writes the choice back into
``optim.moment_dtype``."""

from __future__ import annotations

from typing import Any

import pytest
from llm_testkit import TINY_MODEL, compose

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess
from longboat.core.engine.memory.budget import GB
from longboat.core.megatron.engine.memory_plan import (
    DecoderShapes,
    OptimizerPlan,
    choose_decoder_plan,
    decoder_state_bytes,
)

LLAMA3_8B = DecoderShapes(hidden=4096, ffn=14336, layers=32, heads=32, query_groups=8,
                          head_dim=128, vocab=128256, seq_len=4096)  # fmt: skip
"""Llama-3-8B at 4096 tokens a row, 8 data-parallel ranks, micro-batch 4. Predicted peaks
(GB) with fp32 moments: full 65.5, full at micro-batch 2 61.5, at 1 59.6; with bf16 moments
3.7 GB less each (8.03B parameters / 8 ranks x 2 moments x 2 bytes): full 61.8, at 2 57.8,
at 1 55.9."""


def _moment_worker(rank: int, world: int) -> dict[str, int]:
    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.family import find_family
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.optimizer import inner_optimizers
    from longboat.llm.train.lm_step import build_train_step

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        cfg = find_family("llm", "llama3").flavor("tiny")
        ts = build_train_step(cfg, OptimConfig(moment_dtype="bf16"), precision="bf16",
                              device="cpu", use_cpu_initialization=True,
                              one_pass_adamw=True)  # fmt: skip
        params = [p for c in ts.chunks for p in c.parameters()]
        moments = 0  # allocated when the update is built: no step taken
        for opt in inner_optimizers(ts.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    moments += sum(opt.state[p][k].numel() * opt.state[p][k].element_size()
                                   for k in ("exp_avg", "exp_avg_sq"))  # fmt: skip
        return {"params": sum(p.numel() for p in params), "moments": moments}
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_bf16_moment_bytes_equal_the_built_optimizer() -> None:
    ((built),) = run_multiprocess(_moment_worker, 1)
    opt = OptimizerPlan(precision="bf16", moment_bytes=2)
    est = decoder_state_bytes(built["params"], opt, microbatches=1)
    assert est.moments == built["moments"] == 2 * 2 * built["params"], (est, built)
    fp32 = decoder_state_bytes(built["params"], OptimizerPlan(precision="bf16"), microbatches=1)
    assert fp32.moments == 2 * est.moments and fp32.masters == est.masters


def _plan(budget_gb: float, **opt: Any):
    return choose_decoder_plan(LLAMA3_8B, OptimizerPlan(data_parallel=8, **opt), micro_batch=4,
                               accum=1, budget=budget_gb * GB, budget_source="test")  # fmt: skip


@pytest.mark.parametrize(
    ("budget_gb", "opt", "expected"),
    [
        (62, {"allow_bf16_moments": True}, ("full", 2, 4)),  # no numerics change fits first
        (60, {"allow_bf16_moments": True}, ("full", 1, 4)),  # the split before bf16 moments
        (59, {"allow_bf16_moments": True}, ("full", 2, 2)),  # bf16 at full, then its splits
        (62, {"moment_bytes": 2, "moments_pinned": True}, ("full", 4, 2)),  # set: counted
        (56, {"moment_bytes": 2, "moments_pinned": True}, ("full", 1, 2)),
    ],
    ids=["fp32_split", "fp32_split_1", "bf16_chosen", "bf16_pinned", "bf16_pinned_split"],
)
def test_chooser_takes_bf16_moments_only_where_nothing_else_fits(
    budget_gb: float, opt: dict[str, Any], expected: tuple[str, int, int]
) -> None:
    plan = _plan(budget_gb, **opt)
    c = plan.choice
    assert (c.recompute, c.micro_batch, c.moment_bytes) == expected, plan.line()
    assert plan.estimate.total <= budget_gb * GB
    chosen_bf16 = expected[2] == 2 and not opt.get("moments_pinned")
    assert plan.changes_numerics == (("optim.moment_dtype=bf16",) if chosen_bf16 else ())
    assert ("optim.moment_dtype=bf16: changes numerics (nothing else fits)" in plan.line()) is (
        chosen_bf16
    )


def test_chooser_numbers_and_refusals_with_bf16_moments() -> None:
    """The recorded peaks (``LLAMA3_8B``); 55 GB fits nothing, and the error names the
    smallest plan with its storage; pinned fp32 moments are never replaced."""
    plan = _plan(59, allow_bf16_moments=True)
    totals = {(c.recompute, c.micro_batch, c.moment_bytes): round(e.total / GB, 1)
              for c, e in plan.options}  # fmt: skip
    assert totals[("full", 1, 4)] == 59.6 and totals[("full", 4, 2)] == 61.8
    assert totals[("full", 2, 2)] == 57.8 and totals[("full", 1, 2)] == 55.9
    # core's order: every fp32 choice, then bf16 at the whole micro-batch, then its splits
    order = [(c.recompute, c.micro_batch, c.moment_bytes) for c, _ in plan.options]
    assert order == [("none", 4, 4), ("selective", 4, 4), ("full", 4, 4), ("full", 2, 4),
                     ("full", 1, 4), ("none", 4, 2), ("selective", 4, 2), ("full", 4, 2),
                     ("full", 2, 2), ("full", 1, 2)]  # fmt: skip
    assert plan.chosen == ("train.recompute=full", "micro-batch 4 -> 2", "optim.moment_dtype=bf16")
    with pytest.raises(ConfigError) as err:
        _plan(55, allow_bf16_moments=True)
    msg = str(err.value)
    assert "at micro-batch 1, optim.moment_dtype=bf16, needs 55.9 GB" in msg, msg
    with pytest.raises(ConfigError) as err:
        _plan(59, moments_pinned=True)  # optim.moment_dtype=fp32 set
    assert "optim.moment_dtype=fp32" in str(err.value) and "needs 59.6 GB" in str(err.value)
    assert _plan(62, allow_bf16_moments=False).choice.moment_bytes == 4


def test_plan_fields_follow_the_config() -> None:
    from longboat.core.megatron.engine.moments import moment_plan_fields

    base = [*TINY_MODEL, "data=synthetic"]
    assert moment_plan_fields(compose(base)) == {
        "moment_bytes": 4, "moments_pinned": False, "allow_bf16_moments": True}  # fmt: skip
    assert moment_plan_fields(compose([*base, "optim.moment_dtype=bf16"])) == {
        "moment_bytes": 2, "moments_pinned": True, "allow_bf16_moments": False}  # fmt: skip
    assert moment_plan_fields(compose([*base, "optim.one_pass_adamw=false"]))[
        "allow_bf16_moments"] is False  # fmt: skip


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
]


def _run_worker(rank: int, world: int) -> dict[str, Any]:
    from longboat.llm.train.training import build_training

    def plan(overrides: list[str]) -> dict[str, Any]:
        try:
            run = build_training(compose([*RUN, *overrides]))
        except ConfigError as exc:
            return {"error": str(exc), "keys": exc.keys}
        try:
            states = [s for o in run.optimizers() for s in o.state.values()]
            return {
                "moment_dtype": run.cfg.optim.moment_dtype,
                "recompute": run.cfg.train.recompute,
                "micro": run.cfg.train.micro_batch_size,
                "line": run.memory_plan.line(),
                "options": {
                    (c.recompute, c.micro_batch, c.moment_bytes): e.total
                    for c, e in run.memory_plan.options
                },
                "state_dtypes": sorted({str(s["exp_avg"].dtype) for s in states}),
            }
        finally:
            run.close()

    out = {"roomy": plan(["train.memory_budget=100"])}
    total = out["roomy"]["options"]
    below = (total[("full", 1, 4)] + total[("full", 1, 2)]) / 2 / GB
    out["bf16"] = plan([f"train.memory_budget={below:.9f}"])  # GB as the key reads it
    out["no_one_pass"] = plan([f"train.memory_budget={below:.9f}", "optim.one_pass_adamw=false"])
    return out


@pytest.mark.multiprocess
def test_run_chooses_bf16_moments_below_every_fp32_plan() -> None:
    """A budget between full recompute at micro-batch 1 with fp32 and with bf16 moments:
    the run keeps bf16 moments (written back, allocated bf16 by the one-pass update, the
    line says it changes numerics); with optim.one_pass_adamw=false nothing fits."""
    ((runs),) = run_multiprocess(_run_worker, 1)
    roomy, bf16, refused = runs["roomy"], runs["bf16"], runs["no_one_pass"]
    assert roomy["moment_dtype"] is None and roomy["state_dtypes"] == [], roomy  # fp32, lazy
    total = roomy["options"]
    budget = (total[("full", 1, 4)] + total[("full", 1, 2)]) / 2
    assert all(t > budget for (_, _, m), t in total.items() if m == 4)  # no fp32 plan fits
    # the first bf16 choice in core's order that fits (here full at the whole micro-batch)
    first = next(k for k, t in total.items() if k[2] == 2 and t <= budget)
    assert first == ("full", 2, 2), total
    assert (bf16["moment_dtype"], bf16["recompute"], bf16["micro"]) == ("bf16", "full", 2), bf16
    assert bf16["state_dtypes"] == ["torch.bfloat16"], bf16
    assert "optim.moment_dtype=bf16: changes numerics (nothing else fits)" in bf16["line"]
    assert refused["keys"] == ["train.memory_budget"], refused
