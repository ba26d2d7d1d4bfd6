"""Core's ``train.*`` / ``export.*`` keys against the llm stack: each probe either composes
and a tiny run acts on it (asserted below) or is refused naming the key, exit 2 on the
command line; every old key name is refused naming its replacement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from llm_testkit import TINY_MODEL

from longboat.core.config.compose import compose_experiment
from longboat.core.config.key_probes import check_probes, key_probes, renamed_key_outcomes
from longboat.core.distributed import run_multiprocess
from longboat.llm.stack import STACK

REFUSED = {
    "train.recompute_components=[vision]",
    "export.format=native",
}
"""What the llm stack refuses of the probes (``export.adapter_dir`` composes with LoRA)."""

TINY = [
    *TINY_MODEL,
    "data=synthetic",
    "data.num_documents=48",
    "data.seq_len=32",
    "data.eval_fraction=0.25",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "lora.enabled=true",
    "logging.progress=false",
    "logging.trackers=[]",
]


def test_core_keys_compose_or_are_refused(tmp_path: Path) -> None:
    check_probes("quickstart", "llm", key_probes(tmp_path), REFUSED, TINY)


def test_refusals_of_the_stack_name_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 on the command line; the llm stack's own limits of the core keys."""
    from longboat.llm.cli import main

    code = main(["train", "experiment=quickstart", "train.recompute_components=[language]"])
    text = capsys.readouterr()
    assert code == 2 and "train.recompute_components" in text.out + text.err
    cases = {
        "train.recompute_layers": ["train.recompute=selective", "train.recompute_layers=1"],
        "export.adapter_dir": ["lora.enabled=false", "export.adapter_dir=/tmp/a"],
    }
    for key, overrides in cases.items():
        with pytest.raises(Exception) as err:
            compose_experiment("quickstart", [*TINY, *overrides], stack="llm")
        assert key in err.value.keys, (key, err.value)


def test_renamed_keys_name_their_replacement() -> None:
    outcomes = renamed_key_outcomes("quickstart", "llm", STACK.renamed_keys, TINY)
    assert all(err is not None for err in outcomes.values()), outcomes
    for old, err in outcomes.items():
        if err is not None:
            assert err.keys == [old], (old, err)
            assert f"use {STACK.renamed_keys[old]}" in str(err)


def _run(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.train import Trainer, typed_config
    from longboat.llm.train.training import build_training

    compiled = build_training(typed_config(compose_experiment(
        "quickstart", [*overrides, "train.compile=true"], stack="llm")))  # fmt: skip
    try:
        layers = [m for c in compiled.step_fn.chunks for m in c.decoder.layers]
        n_compiled = sum(m._compiled_call_impl is not None for m in layers)
    finally:
        compiled.close()
    cfg = typed_config(compose_experiment("quickstart", overrides, stack="llm"))
    training = build_training(cfg)
    try:
        result = Trainer(cfg, training).fit()
        tc = training.step_fn.chunks[0].config
        return {
            "compiled": (n_compiled, len(layers)),
            "end": result.end_step,
            "eval": sorted(result.eval),
            "export": str(result.export_dir),
            "metrics": str(result.metrics_path),
            "recompute": (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers),
            "precision": training.precision,
        }
    finally:
        training.close()


@pytest.mark.multiprocess
def test_a_tiny_run_acts_on_the_keys(tmp_path: Path) -> None:
    """train.compile (each decoder layer compiled), then one 2-step run: train.steps,
    log_every, eval_every, the profiler window, recompute (full, first layer), precision
    (fp32 on CPU), export.dir and export.adapter_dir (LoRA)."""
    out, adapter = tmp_path / "hf_here", tmp_path / "adapter_here"
    overrides = [
        *TINY,
        f"output_dir={tmp_path / 'run'}",
        "train.steps=2",
        "train.log_every=2",
        "train.eval_every=1",
        "train.profiler.enabled=true",
        "train.profiler.start_step=2",
        "train.profiler.end_step=2",
        "train.recompute=full",
        "train.recompute_layers=1",
        "train.precision=fp32",
        f"export.dir={out}",
        f"export.adapter_dir={adapter}",
    ]
    res = run_multiprocess(_run, 1, overrides, timeout=600)[0]
    assert res["compiled"] == (4, 4)
    assert res["end"] == 2 and res["eval"] == [0, 1, 2]
    metrics = Path(res["metrics"])
    steps = [line for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 1 and '"step": 2' in steps[0]
    assert (metrics.parent / "profile" / "trace_steps2-2_rank0.json").is_file()
    assert res["recompute"] == ("full", "block", 1) and res["precision"] == "fp32"
    assert res["export"] == str(out) and (out / "config.json").is_file()
    assert (adapter / "adapter_config.json").is_file()
