"""The embodied run's memory plan (``train.memory_budget``): the probe of a tiny policy, the
choice written back into the run (recompute wrappers, the micro-batch split), pinned keys,
and the real pi0.5 shapes (slow)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from embodied_testkit import tiny_run_overrides
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.engine.memory.budget import GB
from longboat.core.engine.memory.plan import PlanChoice
from longboat.core.engine.torch.blocks import find_blocks
from longboat.core.train import typed_config
from longboat.embodied.train.memory_plan import plan_run_memory
from longboat.embodied.train.training import build_training


def _build(tmp: Path, *extra: str):
    overrides = tiny_run_overrides(tmp, "train.micro_batch_size=4", *extra)
    return build_training(typed_config(compose_experiment("groot_n1_6_tiny", overrides)))


def test_the_plan_chooses_recompute_then_splits_and_keeps_pinned_keys(tmp_path: Path) -> None:
    """A budget just under the no-recompute peak: full recompute (every block wrapped);
    under the full-recompute peak: the micro-batch split (same global batch); a pinned
    recompute that cannot fit with one micro-batch a step: refused with the numbers."""
    roomy = _build(tmp_path / "a", "train.memory_budget=1000")
    try:
        plan = roomy.memory_plan
        assert plan.choice == PlanChoice("none", 4, 4) and plan.chosen == ()
        peaks = {c: e.total for c, e in plan.options}
        assert not any(isinstance(m, CheckpointWrapper) for m in roomy.model.modules())
        assert roomy.cfg.train.recompute == "none" and roomy.layout.accum == 1
        # the state bytes are the optimizer's own buffers (master weights on the CPU)
        opt = roomy.optimizer
        state = plan.estimate.states
        assert state.weights == opt.flat_param.nbytes
        assert state.moments == opt.exp_avg.nbytes + opt.exp_avg_sq.nbytes
        none, selective, full = (peaks[PlanChoice(m, 4, 4)] for m in ("none", "selective", "full"))
        assert none > selective > full
        data, cfg, model_cfg, acc = roomy.data, roomy.cfg, roomy.model_cfg, roomy.accelerator
    finally:
        roomy.close()

    budget = (full + selective) / 2 / GB
    tight = _build(tmp_path / "b", f"train.memory_budget={budget}")
    try:
        assert tight.memory_plan.choice == PlanChoice("full", 4, 4)
        assert tight.cfg.train.recompute == "full"
        wrapped = [m for m in tight.model.modules() if isinstance(m, CheckpointWrapper)]
        assert len(wrapped) == len(find_blocks(tight.model)) > 0
        assert not tight.cfg.train.cuda_graph
        line = next(x for x in tight.describe() if x.startswith("Memory plan"))
        assert "chose train.recompute=full" in line and "predicted peak" in line
    finally:
        tight.close()

    # The same probe, a budget under full recompute at 4 samples: micro-batches of 2.
    split_at = (peaks[PlanChoice("full", 2, 4)] + full) / 2 / GB
    cfg.train = dataclasses.replace(cfg.train, memory_budget=str(split_at), recompute=None)
    layout = dataclasses.replace(roomy.layout)
    split = plan_run_memory(cfg, model_cfg, data, layout, acc, master_weights=True,
                            strategy="ddp")  # fmt: skip
    assert split.choice == PlanChoice("full", 2, 4)
    assert split.chosen == ("train.recompute=full", "micro-batch 4 -> 2")
    cfg.train = dataclasses.replace(cfg.train, recompute="none", cuda_graph=True)
    with pytest.raises(ConfigError) as err:
        plan_run_memory(cfg, model_cfg, data, layout, acc, master_weights=True, strategy="ddp")
    assert err.value.keys == ["train.memory_budget"]
    assert "train.recompute=none, one micro-batch a step" in str(err.value)


def test_without_a_budget_the_cpu_run_plans_nothing(tmp_path: Path) -> None:
    run = _build(tmp_path)
    try:
        assert run.memory_plan.startswith("Memory plan: none (the cpu device reports no memory")
        assert run.cfg.train.recompute == "none" and run.callbacks() == []
    finally:
        run.close()


@pytest.mark.slow
def test_pi05_benchmark_shapes_fit_an_h100_with_full_recompute() -> None:
    """pi0.5 at its full shapes, batch 32 (the benchmark's), on meta: 42.5 GB of state
    (3.24B trainable parameters at 14 bytes: bf16 weights and grads, split masters, fp32
    moments) and ~94 GB of activations: the 126 GB measured on the H200; an 80 GB H100's
    budget takes full recompute."""
    from longboat.core.engine.memory.activations import profile_activations
    from longboat.core.engine.memory.plan import choose_plan
    from longboat.core.engine.memory.states import OptimizerLayout, state_bytes
    from longboat.core.engine.torch.master_weights import ALIGN
    from longboat.embodied.models.init_from import resolve_model_config
    from longboat.embodied.models.synthetic import synthetic_batch
    from longboat.embodied.train.memory_plan import probe_policy
    from longboat.kernels import meta_stands_for

    cfg = typed_config(compose_experiment("pi05_tiny", ["model=pi05", "train.precision=bf16"]))
    model_cfg = resolve_model_config("pi05", "full", {}, None)
    model = probe_policy(cfg, model_cfg, master_weights=True)
    layout = OptimizerLayout(master_weights=True, master_storage="split", align=ALIGN)
    states = state_bytes(model.parameters(), layout)
    assert states.trainable_params == 3_244_377_872
    assert states.total / GB == pytest.approx(42.5, abs=0.1)

    def batch(n: int) -> dict[str, torch.Tensor]:  # the 968-token prefix of the benchmark
        b = synthetic_batch(model_cfg, n, text_len=168, image_size=(224, 224), num_cameras=3)
        return {k: v.to("meta") for k, v in b.items()}

    with meta_stands_for("cuda"):
        profile = profile_activations(model, lambda b: model(b)["loss"], batch,
                                      blocks=find_blocks(model), autocast_dtype=torch.bfloat16)  # fmt: skip
    assert profile.saved(32) / GB == pytest.approx(93.8, rel=0.05)
    plan = choose_plan(states, layout, profile, micro_batch=32, budget=0.9 * 79.1 * GB,
                       budget_source="H100")  # fmt: skip
    assert plan.choice == PlanChoice("full", 32, 4)
    assert plan.estimate.total / GB == pytest.approx(50.8, abs=1.0)


@pytest.mark.gpu
def test_a_gpu_run_plans_for_the_free_memory_and_reports_the_measured_peak(
    tmp_path: Path,
) -> None:
    """On a GPU, ``auto`` plans for 90% of the free memory and the run prints the measured
    peak after 5 steps."""
    from longboat.core.engine.memory.report import MeasuredPeak
    from longboat.core.train import Trainer

    cfg = typed_config(compose_experiment("groot_n1_6_tiny", tiny_run_overrides(
        tmp_path, "train.steps=6", "export.enabled=false")))  # fmt: skip
    run = build_training(cfg)
    try:
        plan = run.memory_plan
        _free, total = run.accelerator.memory_capacity()
        assert 0 < plan.budget <= 0.9 * total and plan.choice.recompute == "none"
        assert plan.budget_source.startswith("auto: 90% of")
        trainer = Trainer(cfg, run)
        trainer.fit()
        report = next(c for c in trainer.callbacks if isinstance(c, MeasuredPeak))
        assert report.line is not None and report.line.startswith("Memory plan: measured peak")
    finally:
        run.close()


def test_storage_changes_only_where_recompute_and_the_split_cannot_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Budgets under every option of the run's own storage (split masters, fp32 moments):
    the plan takes bf16 moments, and under every bf16-moment option bf16 weights without
    masters too, writes them into the run (the optimizer holds that storage) and its line
    says they change numerics; a budget that recompute meets changes no storage.

    Slices of 4096 elements: the CPU update's fp32 scratch (one slice each of grads,
    masters and, with bf16 moments, both moments) is then small beside the state, as at a
    real model's size (at the default 32M-element slice the tiny policy's scratch is the
    whole model again, and bf16 moments would cost more than they save)."""
    from longboat.core.engine.torch import master_weights as mw_module
    from longboat.embodied.train import memory_plan as plan_module
    from longboat.embodied.train.memory_plan import resolve_storage

    monkeypatch.setattr(mw_module, "CHUNK", 4096)
    monkeypatch.setattr(plan_module, "CHUNK", 4096)

    roomy = _build(tmp_path / "a", "train.memory_budget=1000")
    try:
        options = roomy.memory_plan.options
        data, cfg, model_cfg, acc = roomy.data, roomy.cfg, roomy.model_cfg, roomy.accelerator
        assert roomy.optimizer.exp_avg.dtype == torch.float32
        assert roomy.optimizer.master_storage == "split" and cfg.optim.moment_dtype == "fp32"
    finally:
        roomy.close()
    peak = {c: e.total for c, e in options}
    own = min(t for c, t in peak.items() if c.moment_bytes == 4 and c.master_storage is None)
    bf16 = min(t for c, t in peak.items() if c.moment_bytes == 2 and c.master_storage is None)
    sr = min(t for c, t in peak.items() if c.master_storage == "bf16_sr")
    assert own > bf16 > sr
    # recompute suffices: the no-recompute peak just missed
    none = peak[PlanChoice("none", 4, 4)]
    selective = peak[PlanChoice("selective", 4, 4)]
    recompute = _build(tmp_path / "b", f"train.memory_budget={(none + selective) / 2 / GB}")
    try:
        plan = recompute.memory_plan
        assert plan.choice == PlanChoice("selective", 4, 4) and plan.changes_numerics == ()
        assert recompute.optimizer.exp_avg.dtype == torch.float32
        assert recompute.optimizer.master_storage == "split"
    finally:
        recompute.close()
    # only bf16 moments fit
    first = next(c for c, t in peak.items() if c.moment_bytes == 2 and t < own)
    run = _build(tmp_path / "c", f"train.memory_budget={(own + peak[first]) / 2 / GB}")
    try:
        plan = run.memory_plan
        assert plan.choice == first and plan.changes_numerics == ("optim.moment_dtype=bf16",)
        assert (
            run.cfg.optim.moment_dtype == "bf16" and run.cfg.train.master_weight_storage == "split"
        )
        assert run.optimizer.exp_avg.dtype == torch.bfloat16
        line = next(x for x in run.describe() if x.startswith("Memory plan"))
        assert "optim.moment_dtype=bf16: changes numerics" in line
    finally:
        run.close()
    # only bf16_sr (with bf16 moments) fits
    first = next(c for c, t in peak.items() if c.master_storage == "bf16_sr" and t < bf16)
    run = _build(tmp_path / "d", f"train.memory_budget={(bf16 + peak[first]) / 2 / GB}")
    try:
        plan = run.memory_plan
        assert plan.choice == first
        assert plan.changes_numerics == (
            "optim.moment_dtype=bf16",
            "train.master_weight_storage=bf16_sr",
        )
        assert run.cfg.train.master_weight_storage == "bf16_sr"
        assert run.optimizer.master_storage == "bf16_sr" and run.optimizer.master_lo is None
        assert plan.estimate.states.masters == 0
        assert plan.estimate.states.moments == run.optimizer.exp_avg.nbytes * 2
    finally:
        run.close()
    # A pinned storage is kept: refused instead, naming the pinned key.
    cfg.train = dataclasses.replace(cfg.train, memory_budget=str((bf16 + sr) / 2 / GB),
                                    recompute=None, master_weight_storage="split")  # fmt: skip
    cfg.optim = dataclasses.replace(cfg.optim, moment_dtype=None)
    with pytest.raises(ConfigError) as err:
        plan_run_memory(cfg, model_cfg, data, dataclasses.replace(run.layout), acc,
                        master_weights=True, strategy="ddp")  # fmt: skip
    assert "train.master_weight_storage=split" in str(err.value)
    resolve_storage(cfg, None)
    assert cfg.optim.moment_dtype == "fp32"
