"""One set of keys: every core ``train.*`` / ``export.*`` key has a probe, the core stack
(the demo) acts on the keys it composes and refuses the others naming the key, and an old
key name, from the command line or from YAML, is refused naming its replacement."""

from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path

import pytest
from fake_stack import write_fake_stack

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.config.key_probes import (
    check_probes,
    key_probes,
    renamed_key_outcomes,
    unprobed_core_keys,
)
from longboat.core.config.renamed import CORE_RENAMED_KEYS
from longboat.core.demo import run

BASE = ["logging.progress=false", "logging.trackers=[]"]

DEMO_REFUSES = {
    "train.recompute=full",
    "train.recompute=selective",
    "train.recompute_layers=1",
    "train.recompute_components=[vision]",
    "train.compile=true",
    "export.format=native",
    "train.precision=fp8",
    "train.fp8.recipe=rowwise",
    "train.fp8.allow_recipe_change=true",
    "train.memory_budget=40",
}
"""Probe ids the core stack refuses (the demo's MLP has no recompute, compile, formats, FP8,
memory plan)."""


def test_every_core_key_has_a_probe() -> None:
    assert unprobed_core_keys() == []


def test_demo_refuses_what_it_cannot_honour_and_composes_the_rest(tmp_path: Path) -> None:
    probes = [p for p in key_probes(tmp_path) if p.key != "export.adapter_dir"]
    check_probes("demo", "core", probes, DEMO_REFUSES, BASE)
    with pytest.raises(ConfigError) as err:
        compose_experiment("demo", [*BASE, f"export.adapter_dir={tmp_path}"], stack="core")
    assert err.value.keys == ["export.adapter_dir"]
    assert "writes no separate adapter" in str(err.value)


def test_demo_acts_on_the_keys_it_composes(tmp_path: Path) -> None:
    """eval_every, the profiler window, export.dir, train.steps and log_every in one run;
    export.enabled=false exports nothing."""
    out = tmp_path / "mlp"
    cfg = compose_experiment(
        "demo",
        [
            *BASE,
            f"output_dir={tmp_path}",
            "train.steps=4",
            "train.log_every=2",
            "train.eval_every=1",
            "train.profiler.enabled=true",
            "train.profiler.start_step=2",
            "train.profiler.end_step=2",
            "train.precision=fp32",
            f"export.dir={out}",
        ],
        stack="core",
    )
    result = run(cfg)
    assert result.end_step == 4 and sorted(result.eval) == [0, 1, 2, 3, 4]
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]
    assert (result.metrics_path.parent / "profile" / "trace_steps2-2_rank0.json").is_file()
    assert result.export_dir == out and (out / "model.safetensors").is_file()
    off = compose_experiment(
        "demo",
        [*BASE, f"output_dir={tmp_path / 'b'}", "train.steps=1", "export.enabled=false"],
        stack="core",
    )
    assert run(off).export_dir is None and not (tmp_path / "b" / "export").exists()


def test_core_renamed_keys_name_their_replacement_on_the_command_line() -> None:
    outcomes = renamed_key_outcomes("demo", "core", CORE_RENAMED_KEYS, BASE)
    for old, err in outcomes.items():
        assert err is not None and err.keys == [old], (old, err)
        assert f"use {CORE_RENAMED_KEYS[old]}" in str(err)


def test_renamed_keys_in_yaml_are_refused_before_the_unknown_key_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stack's ``renamed_keys`` and core's, written in an experiment YAML."""
    module = f"fake_stack_{uuid.uuid4().hex[:8]}"
    conf = write_fake_stack(tmp_path / "site", "fake", module=module)
    (conf / "experiment" / "old_keys.yaml").write_text(
        textwrap.dedent(
            """\
            # @package _global_
            defaults:
              - override /model: gpt
              - _self_
            train:
              old_steps: 3
              activation_checkpointing: full
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ConfigError) as err:
        compose_experiment("old_keys", stack="fake")
    assert sorted(err.value.keys) == ["train.activation_checkpointing", "train.old_steps"]
    text = str(err.value)
    assert "was renamed to train.steps" in text and "was renamed to train.recompute" in text
    assert "unknown key" not in text


def test_bf16_moments_are_refused_where_the_stack_keeps_fp32_moments() -> None:
    for bad in ("optim.moment_dtype=bf16", "optim.moment_dtype=fp16"):
        with pytest.raises(ConfigError) as err:
            compose_experiment("demo", [*BASE, bad], stack="core")
        assert err.value.keys[0] == "optim.moment_dtype"
    cfg = compose_experiment("demo", [*BASE, "optim.moment_dtype=fp32"], stack="core")
    assert cfg.optim.moment_dtype == "fp32"
