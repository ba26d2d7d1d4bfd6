"""``longboat-diffusion train`` with the flux family (CPU, tiny FLUX): the run the command line
assembles trains 3 steps of flow matching with logit-normal timesteps on one-frame synthetic
squares latents (2x2 patch tokens), and its diffusers export gives the trained model's outputs
in ``FluxTransformer2DModel``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FluxTransformer2DModel

import longboat.diffusion.models.flux.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.distributed import run_multiprocess
from longboat.diffusion.models.common.patches import patchify, unpatchify

STEPS = 3
EXPORT_TOL = 1e-4  # the trained model vs diffusers loading its export (fp32)


def _overrides(out: Path) -> list[str]:
    return [
        f"output_dir={out}",
        f"data.out_dir={out / 'data'}",
        "model=flux_tiny",
        "model.overrides={}",
        "data.patch_size=[1,2,2]",
        "data.shapes=[[1,8,8]]",  # images: one latent frame
        "data.num_samples=16",
        "data.num_eval_samples=4",
        "objective.timestep_sampling=logit_normal",
        "train.micro_batch_size=4",
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "train.log_every=1",
        "optim.lr=1e-2",
        "optim.schedule.warmup_steps=0",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.every_steps=0",
        "diffusion.preview_captions=2",
        "diffusion.sample_steps=2",
    ]


def _probe() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return (
        torch.randn(2, 16, 1, 6, 8, generator=g),
        torch.tensor([250.0, 750.0]),
        torch.randn(2, 5, 32, generator=g),
    )


def _run_worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import Trainer, typed_config
    from longboat.diffusion.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="diffusion"))
    training = build_training(cfg)
    try:
        params = training.step_fn.model.named_parameters
        initial = {k: v.detach().clone() for k, v in params()}
        result = Trainer(cfg, training).fit()
        model = training.step_fn.model
        with torch.no_grad():
            probe = model(*_probe())
        still = [k for k, v in params() if torch.equal(v, initial[k])]
        return {
            "losses": result.losses,
            "export": str(result.export_dir),
            "describe": training.describe(),
            "preview": result.extra.get("preview"),
            "probe": probe,
            "unchanged": still,
        }
    finally:
        training.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("flux_run")
    return run_multiprocess(_run_worker, 1, _overrides(root), timeout=300)[0]


def test_flux_trains_three_steps(run: dict[str, Any]) -> None:
    values = run["losses"]
    assert len(values) == STEPS
    assert all(torch.isfinite(torch.tensor(v)) for v in values)
    # The zero-initialised head predicts 0 at step 1: the loss is E[(noise - x0)^2] > 1.
    assert values[0] > 1.0 and len(set(values)) == 3
    # Every tensor was updated but the pooled-text projection's weight: the synthetic sets
    # carry no pooled embedding, so the model gets zeros there and that weight no gradient.
    assert run["unchanged"] == ["pooled_embedder.linear_1.weight"]
    line = run["describe"][0]
    assert line.startswith("Model flux/tiny: 4 blocks x 32 (2 heads), patch 1x2x2, 16 latent")
    assert "logit_normal timesteps" in run["describe"][2]
    assert run["preview"] and Path(run["preview"]).is_file()


def test_export_loads_in_diffusers_with_equal_outputs(run: dict[str, Any]) -> None:
    model = FluxTransformer2DModel.from_pretrained(run["export"]).eval()
    lat, ts, text = _probe()
    ids = torch.zeros(3, 4, 3)
    ids[..., 1] = torch.arange(3)[:, None]
    ids[..., 2] = torch.arange(4)[None, :]
    with torch.no_grad():
        out = model(
            hidden_states=patchify(lat, (1, 2, 2)),
            encoder_hidden_states=text,
            pooled_projections=torch.zeros(2, 32),  # the run had no pooled embeddings
            timestep=ts / 1000.0,
            img_ids=ids.reshape(-1, 3),
            txt_ids=torch.zeros(5, 3),
            return_dict=False,
        )[0]
    want = unpatchify(out, (1, 3, 4), (1, 2, 2))
    assert want.abs().max() > 1e-3  # the trained head is no longer zero
    assert (want - run["probe"]).abs().max() < EXPORT_TOL
