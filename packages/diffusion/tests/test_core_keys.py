"""Core's ``train.*`` / ``export.*`` keys against the diffusion stack: each probe either
composes and the tiny run acts on it (asserted below) or is refused naming the key, exit 2
on the command line; every old key name is refused naming its replacement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import longboat.diffusion.models.wan.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.config.compose import compose_experiment
from longboat.core.config.key_probes import check_probes, key_probes, renamed_key_outcomes
from longboat.core.distributed import run_multiprocess
from longboat.diffusion.stack import STACK

# train.precision=fp8 and train.fp8.*: composed here, acted on in test_fp8_train.py (an FP8
# step on CPU through the emulated GEMMs; the command line refuses a CPU run, exit 2).
REFUSED = {
    "train.recompute_components=[vision]",
    "train.compile=true",
    "export.format=native",
    "export.adapter_dir={tmp}/adapter_dir",
}
"""What the diffusion stack refuses (``{tmp}``: the probes' folder)."""

TINY = [
    "data.num_samples=16",
    "data.num_eval_samples=8",
    "data.shapes=[[1,4,4],[3,4,4]]",
    "model.overrides.num_layers=2",
    "model.overrides.num_attention_heads=2",
    "model.overrides.ffn_dim=64",
    "model.overrides.attention_head_dim=16",
    "train.micro_batch_size=4",
    "logging.progress=false",
    "logging.trackers=[]",
    "diffusion.preview=false",
]


def test_core_keys_compose_or_are_refused(tmp_path: Path) -> None:
    refused = {r.replace("{tmp}", str(tmp_path)) for r in REFUSED}
    check_probes("quickstart", "diffusion", key_probes(tmp_path), refused, TINY)


def test_refusal_exits_2_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from longboat.diffusion.cli import main

    code = main(["train", "experiment=quickstart", "train.compile=true", "train.recompute=full"])
    text = capsys.readouterr()
    assert code == 2 and "train.compile" in text.out + text.err


def test_renamed_keys_name_their_replacement() -> None:
    outcomes = renamed_key_outcomes("quickstart", "diffusion", STACK.renamed_keys, TINY)
    for old, err in outcomes.items():
        assert err is not None and err.keys == [old], (old, err)
        assert f"use {STACK.renamed_keys[old]}" in str(err)


def _recompute(mode: str, layers: str = "null") -> tuple[int, bool]:
    from longboat.diffusion.train.checks import model_config

    overrides = [*TINY, f"train.recompute={mode}", f"train.recompute_layers={layers}"]
    cfg = OmegaConf.to_object(compose_experiment("quickstart", overrides, stack="diffusion"))
    arch = model_config(cfg.model, cfg.train)
    return arch.num_recomputed(), arch.recompute_attention


def test_recompute_modes_set_the_blocks_and_attention() -> None:
    """none: no block; selective: every block (or the first n), attention outputs kept; full:
    attention recomputed too. model=wan_t2v_14b recomputes its first 32 blocks."""
    assert _recompute("none") == (0, False)
    assert _recompute("selective") == (2, False)
    assert _recompute("selective", "1") == (1, False)
    assert _recompute("full") == (2, True)
    big = compose_experiment("quickstart", ["model=wan_t2v_14b"], stack="diffusion", validate=False)
    assert (big.train.recompute, big.train.recompute_layers) == ("selective", 32)


def _run(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.train import Trainer, typed_config
    from longboat.diffusion.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="diffusion"))
    training = build_training(cfg)
    try:
        result = Trainer(cfg, training).fit()
        model = training.step_fn.model
        return {
            "end": result.end_step,
            "eval": sorted(result.eval),
            "export": str(result.export_dir),
            "metrics": str(result.metrics_path),
            "recompute": (model.recompute_blocks, model.recompute_attention),
            "precision": training.precision,
        }
    finally:
        training.close()


@pytest.mark.multiprocess
def test_a_tiny_run_acts_on_the_keys(tmp_path: Path) -> None:
    """train.steps, log_every, eval_every, the profiler window, recompute (full, first
    block), precision (fp32) and export.dir in one 2-step run."""
    out = tmp_path / "diffusers_here"
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
        "train.recompute_layers=1",
        "train.precision=fp32",
        f"export.dir={out}",
    ]
    res = run_multiprocess(_run, 1, overrides, timeout=400)[0]
    assert res["end"] == 2 and res["eval"] == [0, 1, 2]
    metrics = Path(res["metrics"])
    steps = [line for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 1 and '"step": 2' in steps[0]
    assert (metrics.parent / "profile" / "trace_steps2-2_rank0.json").is_file()
    assert res["recompute"] == (1, True) and res["precision"] == "fp32"
    assert res["export"] == str(out) and (out / "config.json").is_file()
