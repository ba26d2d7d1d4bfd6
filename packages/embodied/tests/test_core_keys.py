"""Core's ``train.*`` / ``export.*`` keys against the embodied stack: each probe either
composes and a tiny run acts on it (asserted below) or is refused naming the key, exit 2 on
the command line; the stack renames no key of its own (core's renames are core's test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from embodied_testkit import tiny_run_overrides

from longboat.core.config.compose import compose_experiment
from longboat.core.config.key_probes import check_probes, key_probes
from longboat.core.distributed import run_multiprocess
from longboat.embodied.stack import STACK

REFUSED = {
    "train.precision=fp8",  # no FP8 training in this stack
    "train.fp8.recipe=rowwise",
    "train.fp8.allow_recipe_change=true",
    "train.recompute_layers=1",
    "train.recompute_components=[vision]",
    "train.precision=fp16",
    "train.cuda_graph=true",  # needs train.master_weights=true, which the tiny fp32 run has off
    "export.adapter_dir={tmp}/adapter_dir",  # without lora.enabled=true (test_train_lora)
}
"""What the embodied stack refuses (``{tmp}``: the probes' folder)."""

EVAL = ["data.eval_episodes=[1]", "data.eval_batches=1"]
"""A held-out episode, so ``train.eval_every`` has something to evaluate."""


def test_core_keys_compose_or_are_refused(tmp_path: Path) -> None:
    refused = {r.replace("{tmp}", str(tmp_path)) for r in REFUSED}
    base = tiny_run_overrides(tmp_path / "run", *EVAL)
    check_probes("groot_n1_6_tiny", "embodied", key_probes(tmp_path), refused, base)
    assert dict(STACK.renamed_keys) == {}


def test_refusal_exits_2_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from longboat.embodied.cli import main

    code = main(["train", "experiment=groot_n1_6_tiny", "train.precision=fp16"])
    text = capsys.readouterr()
    assert code == 2 and "train.precision" in text.out + text.err


def _run(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from longboat.core.train import Trainer, typed_config
    from longboat.embodied.train.training import build_training

    compiled = build_training(typed_config(compose_experiment(
        "groot_n1_6_tiny", [*overrides, "train.compile=true"], world_size=1)))  # fmt: skip
    try:
        n_compiled = compiled.counts.get("compiled_blocks", 0)
    finally:
        compiled.close()
    cfg = typed_config(compose_experiment("groot_n1_6_tiny", overrides, world_size=1))
    training = build_training(cfg)
    try:
        result = Trainer(cfg, training).fit()
        model = training.model
        trainable = [p for p in model.parameters() if p.requires_grad]
        return {
            "compiled": n_compiled,
            "end": result.end_step,
            "eval": sorted(result.eval),
            "export": str(result.export_dir),
            "metrics": str(result.metrics_path),
            "wrapped": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
            "dtypes": sorted({str(p.dtype) for p in trainable}),
        }
    finally:
        training.close()


@pytest.mark.multiprocess
def test_a_tiny_run_acts_on_the_keys(tmp_path: Path) -> None:
    """train.compile (the parallel blocks compiled), then one 2-step run: train.steps,
    log_every, eval_every, the profiler window, recompute (full: every block wrapped),
    precision (bf16 weights), export.dir and export.format=native (no second export)."""
    out = tmp_path / "policy_here"
    overrides = tiny_run_overrides(
        tmp_path / "run",
        *EVAL,
        "train.log_every=2",
        "train.eval_every=1",
        "train.profiler.enabled=true",
        "train.profiler.start_step=2",
        "train.profiler.end_step=2",
        "train.recompute=full",
        f"export.dir={out}",
        "export.format=native",
    )
    res = run_multiprocess(_run, 1, overrides, timeout=600)[0]
    assert res["compiled"] > 0
    assert res["end"] == 2 and res["eval"] == [0, 1, 2]
    metrics = Path(res["metrics"])
    steps = [line for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 1 and '"step": 2' in steps[0]
    assert (metrics.parent / "profile" / "trace_steps2-2_rank0.json").is_file()
    assert res["wrapped"] > 0 and res["dtypes"] == ["torch.bfloat16"]
    assert res["export"] == str(out) and (out / "model.safetensors").is_file()
    assert not (out / "isaac").exists()
