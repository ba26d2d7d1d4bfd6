"""Core's ``train.*`` / ``export.*`` keys against the vlm stack: each probe either composes
and a tiny run acts on it (asserted below) or is refused naming the key, exit 2 on the
command line; every old key name is refused naming its replacement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from longboat.core.config.compose import compose_experiment
from longboat.core.config.key_probes import check_probes, key_probes, renamed_key_outcomes
from longboat.core.distributed import run_multiprocess
from longboat.vlm.stack import STACK

# train.precision=fp8 and train.fp8.*: composed here, acted on in test_fp8_train.py (an FP8
# step on CPU through the emulated GEMMs; the command line refuses a CPU run, exit 2).
REFUSED = {
    "train.recompute=selective",
    "train.recompute_layers=1",
    "train.compile=true",
    "export.format=native",
    "export.adapter_dir={tmp}/adapter_dir",
}
"""What the vlm stack refuses (``{tmp}``: the probes' folder)."""

TINY = [
    "data.num_train=24",
    "data.num_eval=4",
    "data.seq_len=256",
    "vlm.answer_eval_samples=0",
    "vlm.eval_batches=1",
    "logging.progress=false",
    "logging.trackers=[]",
]


def test_core_keys_compose_or_are_refused(tmp_path: Path) -> None:
    refused = {r.replace("{tmp}", str(tmp_path)) for r in REFUSED}
    check_probes("quickstart", "vlm", key_probes(tmp_path), refused, TINY)


def test_refusal_exits_2_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from longboat.vlm.cli import main

    code = main(["train", "experiment=quickstart", "train.compile=true"])
    text = capsys.readouterr()
    assert code == 2 and "train.compile" in text.out + text.err


def test_renamed_keys_name_their_replacement() -> None:
    outcomes = renamed_key_outcomes("quickstart", "vlm", STACK.renamed_keys, TINY)
    for old, err in outcomes.items():
        assert err is not None and err.keys == [old], (old, err)
        assert f"use {STACK.renamed_keys[old]}" in str(err)


def test_recompute_components_of_each_mode() -> None:
    from longboat.vlm.train.training import recompute_components

    def parts(*overrides: str) -> tuple[str, ...]:
        cfg = compose_experiment("quickstart", [*TINY, *overrides], stack="vlm")
        return recompute_components(cfg.train)

    assert parts() == ()
    assert parts("train.recompute=full") == ("vision", "language")
    assert parts("train.recompute=full", "train.recompute_components=[language]") == ("language",)


def _run(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.train import Trainer, typed_config
    from longboat.vlm.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="vlm"))
    training = build_training(cfg)
    try:
        result = Trainer(cfg, training).fit()
        model = training.step_fn.model
        return {
            "end": result.end_step,
            "eval": sorted(result.eval),
            "export": str(result.export_dir),
            "metrics": str(result.metrics_path),
            "recompute": (model.vision.recompute, model.language.config.recompute_granularity),
            "precision": training.precision,
        }
    finally:
        training.close()


@pytest.mark.multiprocess
def test_a_tiny_run_acts_on_the_keys(tmp_path: Path) -> None:
    """train.steps, log_every, eval_every, the profiler window, recompute (full, the vision
    tower only), precision (fp32) and export.dir in one 2-step run."""
    out = tmp_path / "hf_here"
    overrides = [
        *TINY,
        f"output_dir={tmp_path / 'run'}",
        f"data.out_dir={tmp_path / 'data'}",
        "train.steps=2",
        "train.log_every=2",
        "train.eval_every=1",
        "train.profiler.enabled=true",
        "train.profiler.start_step=2",
        "train.profiler.end_step=2",
        "train.recompute=full",
        "train.recompute_components=[vision]",
        "train.precision=fp32",
        f"export.dir={out}",
    ]
    res = run_multiprocess(_run, 1, overrides, timeout=600)[0]
    assert res["end"] == 2 and res["eval"] == [0, 1, 2]
    metrics = Path(res["metrics"])
    steps = [line for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 1 and '"step": 2' in steps[0]
    assert (metrics.parent / "profile" / "trace_steps2-2_rank0.json").is_file()
    assert res["recompute"] == (True, None) and res["precision"] == "fp32"
    assert res["export"] == str(out) and (out / "config.json").is_file()
