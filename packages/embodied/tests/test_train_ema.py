"""EMA of a policy's weights (core's ``ema.*``) in embodied runs: with master weights, the
exported average equals the fp32 average of the per-step weights by its formula, the fp32
masters and the bf16 weights are untouched by the export, and a run resumed from a
checkpoint exports the same average as an uninterrupted one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from embodied_testkit import tiny_run_overrides

DECAY, START = 0.5, 2


def _run(out: Path, steps: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import Trainer, typed_config
    from longboat.embodied.train.training import build_training

    overrides = tiny_run_overrides(
        out,
        "train.master_weights=true",
        f"train.steps={steps}",
        "checkpoint.every_steps=2",
        "optim.schedule.name=constant",  # the same LR whatever train.steps is (resume)
        "optim.schedule.warmup_steps=0",
        "ema.enabled=true",
        f"ema.decay={DECAY}",
        f"ema.start_step={START}",
        "ema.export=true",
    )
    cfg = typed_config(compose_experiment("groot_n1_6_tiny", overrides, world_size=1))
    training = build_training(cfg)
    model = training.model
    per_step: dict[int, dict[str, torch.Tensor]] = {}
    masters: dict[str, dict[str, torch.Tensor]] = {}

    def params() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    def on_step(step: int) -> None:
        per_step[step] = params()
        if step == steps:  # the fp32 masters the export starts from
            with training.optimizer.master_params():
                masters["before"] = params()

    try:
        result = Trainer(cfg, training, on_step=on_step).fit()
        with training.optimizer.master_params():
            masters["after"] = params()
        return {
            "start": result.start_step,
            "per_step": per_step,
            "exported": load_file(str(Path(result.export_dir) / "model.safetensors")),
            "after": params(),
            "masters": masters,
            "trainable": {k for k, v in model.named_parameters() if v.requires_grad},
            "describe": training.describe(),
        }
    finally:
        training.close()


def test_exported_average_follows_the_steps_and_survives_a_resume(tmp_path: Path) -> None:
    whole = _run(tmp_path / "a", 4)
    per_step, trainable = whole["per_step"], whole["trainable"]
    want = {k: v.float() for k, v in per_step[1].items()}  # step 1 < start: copied
    for step in (2, 3, 4):
        for k in want:
            want[k] = torch.lerp(want[k], per_step[step][k].float(), 1.0 - DECAY)
    for k in trainable:
        assert whole["exported"][k].dtype == torch.float32, k
        assert torch.allclose(whole["exported"][k], want[k], atol=1e-6, rtol=0), k
    assert any(not torch.equal(want[k], per_step[4][k].float()) for k in trainable)
    for k, v in whole["after"].items():
        assert torch.equal(v, per_step[4][k]), k  # the bf16 weights are back
    masters = whole["masters"]
    for k in trainable:  # the fp32 masters too
        assert torch.equal(masters["after"][k], masters["before"][k]), k
        assert not torch.equal(masters["after"][k], whole["exported"][k]), k
    assert any("EMA of the weights (fp32): decay 0.5" in line for line in whole["describe"])

    _run(tmp_path / "b", 2)
    resumed = _run(tmp_path / "b", 4)
    assert resumed["start"] == 2
    for k, v in whole["exported"].items():
        assert torch.equal(resumed["exported"][k], v), k
