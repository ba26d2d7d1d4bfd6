"""EMA of the transformer's weights (core's ``ema.*``) in diffusion runs: the exported average
equals the average of the per-step weights by its formula, the model keeps its trained
weights after the export, and a run resumed from a checkpoint exports the same average as an
uninterrupted one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import longboat.diffusion.models.wan.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.distributed import run_multiprocess

DECAY, START = 0.5, 2


def _overrides(out: Path, data: Path, steps: int) -> list[str]:
    return [
        f"output_dir={out}",
        f"data.out_dir={data}",
        "data.num_samples=16",
        "data.num_eval_samples=0",
        "data.shapes=[[1,4,4]]",
        "model.overrides.num_layers=1",
        "model.overrides.ffn_dim=64",
        "train.micro_batch_size=8",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "optim.lr=1e-2",
        "optim.schedule.name=constant",  # the same LR whatever train.steps is (resume)
        "optim.schedule.warmup_steps=0",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.every_steps=2",
        "diffusion.preview=false",
        "ema.enabled=true",
        f"ema.decay={DECAY}",
        f"ema.start_step={START}",
        "ema.export=true",
    ]


def _worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import Trainer, typed_config
    from longboat.diffusion.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="diffusion"))
    training = build_training(cfg)
    model = training.step_fn.model
    per_step: dict[int, dict[str, torch.Tensor]] = {}

    def on_step(step: int) -> None:
        per_step[step] = {k: v.detach().clone() for k, v in model.named_parameters()}

    try:
        result = Trainer(cfg, training, on_step=on_step).fit()
        from safetensors.torch import load_file

        from longboat.diffusion.models.wan import diffusers as wan_io

        theirs = load_file(Path(result.export_dir) / "diffusion_pytorch_model.safetensors")
        exported = wan_io.from_diffusers_state_dict(theirs, training.model_cfg)
        return {
            "start": result.start_step,
            "per_step": per_step,
            "exported": exported,
            "after": {k: v.detach().clone() for k, v in model.named_parameters()},
            "describe": training.describe(),
        }
    finally:
        training.close()


@pytest.mark.multiprocess
def test_exported_average_follows_the_steps_and_survives_a_resume(tmp_path: Path) -> None:
    data = tmp_path / "data"
    whole = run_multiprocess(_worker, 1, _overrides(tmp_path / "a", data, 4), timeout=300)[0]
    per_step = whole["per_step"]
    want = {k: v.clone() for k, v in per_step[1].items()}  # step 1 < start: copied
    for step in (2, 3, 4):
        for k in want:
            want[k] = torch.lerp(want[k], per_step[step][k], 1.0 - DECAY)
    for k, v in want.items():
        assert torch.allclose(whole["exported"][k], v, atol=1e-6, rtol=0), k
    assert any(not torch.equal(want[k], per_step[4][k]) for k in want)  # not the weights
    for k, v in whole["after"].items():
        assert torch.equal(v, per_step[4][k]), k  # the trained weights are back
    assert any("EMA of the weights (fp32): decay 0.5" in line for line in whole["describe"])

    run_multiprocess(_worker, 1, _overrides(tmp_path / "b", data, 2), timeout=300)
    resumed = run_multiprocess(_worker, 1, _overrides(tmp_path / "b", data, 4), timeout=300)[0]
    assert resumed["start"] == 2
    for k, v in whole["exported"].items():
        assert torch.equal(resumed["exported"][k], v), k


def test_ema_keys_are_checked() -> None:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        compose_experiment("quickstart", ["ema.enabled=true", "ema.decay=1.5"], stack="diffusion")
    assert err.value.keys == ["ema.decay"]
