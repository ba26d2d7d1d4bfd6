"""The memory plan's chooser and budget (``longboat.core.engine.memory``): decisions on a
profile recorded at pi0.5's full shapes, ``train.memory_budget`` values, the measured-peak
line."""

from __future__ import annotations

import pytest

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.device.cpu import CPUAccelerator
from longboat.core.engine.memory.activations import ActivationProfile, SavedBytes
from longboat.core.engine.memory.budget import (
    GB,
    format_bytes,
    parse_memory_budget,
    resolve_budget_bytes,
)
from longboat.core.engine.memory.plan import (
    Pins,
    PlanChoice,
    choose_plan,
    estimate_peak,
    micro_batch_options,
    recomputed_blocks,
)
from longboat.core.engine.memory.report import MeasuredPeak
from longboat.core.engine.memory.states import OptimizerLayout, StateBytes

MB = 1 << 20
TRAINABLE = 3_244_377_872
"""pi0.5 (full): trainable parameters; 109,053,952 frozen (bf16)."""
VIT, JOINT = 27, 18
"""SigLIP blocks and joint (Gemma LM + action expert) layers."""
PER_SAMPLE = {"vit": 26.2 * MB, "joint": 133.4 * MB, "last": 17.9 * MB}
"""Saved bytes a sample of pi0.5's benchmark shapes (3 cameras at 224x224, a 968-token
prefix, 50 action tokens, bf16) costs each block, recorded with the meta probe (the last
joint layer runs only the action expert's path)."""
INPUTS = {"vit": 1.7 * MB, "joint": 4.9 * MB}
"""Bytes a sample of each block's inputs holds."""

LAYOUT = OptimizerLayout(master_weights=True, master_storage="split", align=64)
STATES = StateBytes(
    weights=2 * TRAINABLE,
    grads=2 * TRAINABLE,
    masters=2 * TRAINABLE,
    moments=8 * TRAINABLE,
    frozen=2 * 109_053_952,
    trainable_params=TRAINABLE,
)


def _saved(samples: int) -> SavedBytes:
    """The recorded profile at ``samples`` samples (one storage per block and input)."""
    kinds = ["vit"] * VIT + ["joint"] * (JOINT - 1) + ["last"]
    blocks = [{i: int(PER_SAMPLE[k] * samples)} for i, k in enumerate(kinds)]
    inputs = [
        {1000 + i: int(INPUTS["vit" if k == "vit" else "joint"] * samples)}
        for i, k in enumerate(kinds)
    ]
    return SavedBytes(blocks, {-1: 9 * MB * samples}, inputs, batch_bytes=samples * 500_000)


PROFILE = ActivationProfile(_saved(1), _saved(2), 1, 2)
H100 = 0.9 * 79.1 * GB
H200 = 0.9 * 139.7 * GB


def _plan(budget: float | None, **kw) -> object:
    return choose_plan(
        STATES, LAYOUT, PROFILE, micro_batch=32, budget=budget, budget_source="test", **kw
    )


def test_recorded_pi05_breakdown() -> None:
    """At batch 32 the persistent state is 42.5 GB and the activations 93.8 GB: the 126 GB
    measured on the H200 (no recompute) is mostly activations."""
    none = estimate_peak(STATES, LAYOUT, PROFILE, PlanChoice("none", 32))
    assert STATES.total / GB == pytest.approx(42.5, abs=0.1)
    assert none.activations / GB == pytest.approx(93.8, abs=0.2)
    full = estimate_peak(STATES, LAYOUT, PROFILE, PlanChoice("full", 32))
    assert full.activations < 5 * GB and full.total < H100


def test_the_chooser_takes_the_least_recompute_that_fits() -> None:
    assert _plan(200 * GB).choice == PlanChoice("none", 32)
    assert _plan(200 * GB).chosen == ()
    kept = "Memory plan: kept train.recompute=none, micro-batch 32; predicted peak 136.6 GB"
    assert _plan(200 * GB).line().startswith(kept)
    h200 = _plan(H200)
    assert h200.choice == PlanChoice("selective", 32)
    assert h200.chosen == ("train.recompute=selective",)
    h100 = _plan(H100)
    assert h100.choice == PlanChoice("full", 32)
    assert h100.estimate.total <= H100
    assert "chose train.recompute=full" in h100.line() and "of a 71.2 GB budget" in h100.line()


def test_bf16_moments_only_where_allowed_then_the_micro_batch_split() -> None:
    with pytest.raises(ConfigError) as err:
        _plan(40 * GB)  # the state alone is 42.5 GB
    assert err.value.keys == ["train.memory_budget"]
    assert "needs 42." in str(err.value) and "nothing pinned" in str(err.value)
    plan = _plan(40 * GB, allow_bf16_moments=True)
    assert plan.choice == PlanChoice("full", 32, moment_bytes=2)
    assert plan.estimate.states.moments == 4 * TRAINABLE
    assert plan.chosen == ("train.recompute=full", "optim.moment_dtype=bf16")
    assert plan.changes_numerics == ("optim.moment_dtype=bf16",)
    assert "optim.moment_dtype=bf16: changes numerics (nothing else fits)" in plan.line()
    split = _plan(45 * GB)
    assert split.choice == PlanChoice("full", 8)  # 16 does not fit, 8 does
    assert split.chosen == ("train.recompute=full", "micro-batch 32 -> 8")


def test_pinned_levers_stay_and_a_pinned_run_that_cannot_fit_is_refused() -> None:
    pinned = _plan(H100, pins=Pins(recompute="none"))
    assert pinned.choice == PlanChoice("none", 8)
    assert pinned.chosen == ("micro-batch 32 -> 8",)
    with pytest.raises(ConfigError) as err:
        _plan(H100, pins=Pins(recompute="none", micro_batch=True))
    text = str(err.value)
    assert "train.recompute=none, one micro-batch a step" in text
    assert "needs 136.6 GB" in text and "unset the pinned keys" in text
    assert _plan(H100, pins=Pins(recompute="selective")).choice.recompute == "selective"


def test_without_a_budget_nothing_is_chosen() -> None:
    plan = _plan(None)
    assert plan.choice == PlanChoice("none", 32) and plan.chosen == ()
    assert plan.line().startswith("Memory plan: no budget (test)")
    assert _plan(None, pins=Pins(recompute="full")).choice.recompute == "full"


def test_recompute_modes_and_micro_batch_options() -> None:
    assert recomputed_blocks("none", 5) == ()
    assert recomputed_blocks("selective", 5) == (0, 2, 4)
    assert recomputed_blocks("full", 3) == (0, 1, 2)
    with pytest.raises(ValueError):
        recomputed_blocks("half", 3)
    assert micro_batch_options(12) == [1, 2, 3, 4, 6, 12]


def test_memory_budget_values() -> None:
    assert parse_memory_budget("auto") is None
    assert parse_memory_budget("40") == parse_memory_budget(40) == 40.0
    assert parse_memory_budget("33.1") == 33.1
    for bad in ("abc", "0", -3, True, "inf"):
        with pytest.raises(ValueError):
            parse_memory_budget(bad)
    cpu = CPUAccelerator()
    assert resolve_budget_bytes("auto", cpu) == (
        None,
        "the cpu device reports no memory to plan for",
    )
    assert resolve_budget_bytes(2, cpu) == (2 * GB, "train.memory_budget=2 GB")
    assert format_bytes(71.2 * GB) == "71.2 GB" and format_bytes(5 * MB) == "5.0 MB"


def test_a_bad_budget_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        compose_experiment("demo", ["train.memory_budget=lots"], stack="core")
    assert "train.memory_budget" in err.value.keys
    assert "auto or a positive number of GB" in str(err.value)


def test_the_measured_peak_line_needs_device_memory() -> None:
    report = MeasuredPeak(CPUAccelerator(), _plan(H100), after_steps=1)
    report.on_step_end(None, 1, None)  # the CPU reports no device memory: nothing printed
    assert report.line is None and report.done


def test_storage_changes_only_where_nothing_else_fits_and_say_so() -> None:
    """pi0.5 at the openpi-style reference's 33 GB: split masters and fp32 moments (14 bytes a
    parameter, 42.5 GB of state) fit at no recompute or micro-batch; bf16 moments (32.4 GB)
    fit at full recompute in micro-batches of 8 (one numerics change before two). At 30 GB
    only bf16 weights without masters and bf16 moments (8 bytes a parameter, as the
    reference keeps) fit: at micro-batches of 16."""
    both = {"allow_bf16_moments": True, "allow_bf16_sr": True}
    plan = _plan(33 * GB, **both)
    assert plan.choice == PlanChoice("full", 8, moment_bytes=2)
    assert plan.estimate.states.moments == 4 * TRAINABLE
    assert plan.estimate.total <= 33 * GB
    assert plan.chosen == ("train.recompute=full", "micro-batch 32 -> 8", "optim.moment_dtype=bf16")
    assert plan.changes_numerics == ("optim.moment_dtype=bf16",)
    sr = _plan(30 * GB, **both)
    assert sr.choice == PlanChoice("full", 16, moment_bytes=2, master_storage="bf16_sr")
    s = sr.estimate.states
    assert (s.masters, s.moments) == (0, 4 * TRAINABLE)
    assert sr.changes_numerics == ("optim.moment_dtype=bf16", "train.master_weight_storage=bf16_sr")
    assert ("chose train.recompute=full, micro-batch 32 -> 16; optim.moment_dtype=bf16, "
            "train.master_weight_storage=bf16_sr: changes numerics") in sr.line()  # fmt: skip
    # The chooser's order: every option without a storage change (3 modes, then micro-batches
    # 16, 8, 4, 2, 1), then the 3 modes with bf16 moments, then with bf16_sr as well, then
    # the splits of each storage level.
    levels = [(c.moment_bytes, c.master_storage) for c, _ in sr.options]
    bf16, sr16 = (2, None), (2, "bf16_sr")
    assert levels == [(4, None)] * 8 + [bf16] * 3 + [sr16] * 3 + [bf16] * 5 + [sr16] * 5
    # Where recompute or the split fits, no storage change, even when allowed.
    assert _plan(H100, **both).choice == PlanChoice("full", 32)
    assert _plan(45 * GB, **both).choice == PlanChoice("full", 8)
    # Pinned storage keys are kept: fp32 moments pinned leaves bf16_sr (12 bytes a
    # parameter) that cannot fit 30 GB: refused with the numbers and the pinned keys.
    with pytest.raises(ConfigError) as err:
        _plan(30 * GB, pins=Pins(moment_bytes=4), **both)
    text = str(err.value)
    assert "optim.moment_dtype=fp32" in text and "train.master_weight_storage=bf16_sr" in text
    with pytest.raises(ConfigError, match=r"train\.master_weight_storage=split"):
        _plan(30 * GB, pins=Pins(master_storage="split"), **both)
