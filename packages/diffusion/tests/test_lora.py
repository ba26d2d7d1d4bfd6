"""LoRA on the diffusion transformer (core's ``lora.*``): only the adapters train, the export
holds the merged weights, and the adapters written as a diffusers LoRA load onto the source
pipeline with ``load_lora_weights`` and give the merged export's outputs (Wan; FLUX, whose
single blocks' two output projections are column pieces of one diffusers ``proj_out``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import longboat.diffusion.models.wan.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess

pytest.importorskip("diffusers")
pytest.importorskip("peft")


def _worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import Trainer, typed_config
    from longboat.diffusion.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="diffusion"))
    training = build_training(cfg)
    model = training.step_fn.model
    try:
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        result = Trainer(cfg, training).fit()
        after = {k: v.detach().clone() for k, v in model.named_parameters()}
        return {
            "before": before,
            "after": after,
            "export": str(result.export_dir),
            "adapter": result.extra.get("adapter_dir"),
            "describe": training.describe(),
            "losses": result.losses,
        }
    finally:
        training.close()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from longboat.diffusion.tiny_pipelines import build_tiny_pipeline

    root = tmp_path_factory.mktemp("lora")
    source = build_tiny_pipeline("wan", root / "tiny_wan")
    overrides = [
        f"output_dir={root / 'run'}",
        f"data.out_dir={root / 'data'}",
        "model=wan_tiny",
        "model.overrides={}",
        f"model.init_from={source}",
        "data.num_samples=16",
        "data.num_eval_samples=0",
        "data.shapes=[[1,4,4],[3,4,4]]",
        "train.micro_batch_size=4",
        "train.steps=3",
        "train.log_every=1",
        "train.eval_every=0",
        "optim.lr=5e-2",
        "optim.schedule.warmup_steps=0",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.every_steps=0",
        "diffusion.preview=false",
        "lora.enabled=true",
        "lora.rank=4",
        "lora.alpha=8",
    ]
    out = run_multiprocess(_worker, 1, overrides, timeout=400)[0]
    return out | {"source": source, "root": root}


@pytest.mark.multiprocess
def test_only_the_adapters_train(lora_run: dict[str, Any]) -> None:
    before, after = lora_run["before"], lora_run["after"]
    adapters = [k for k in before if k.endswith(("lora_A", "lora_B"))]
    # q, k, v, proj of self- and cross-attention + fc1, fc2, in each of 2 blocks
    assert len(adapters) == 2 * 2 * (2 * 4 + 2)
    for k in before:
        if k in adapters:
            continue
        assert torch.equal(before[k], after[k]), k
    moved = [k for k in adapters if k.endswith("lora_B") and after[k].abs().max() > 0]
    assert len(moved) == len(adapters) // 2
    assert any("LoRA: rank 4, alpha 8 on 20 linears" in line for line in lora_run["describe"])


@pytest.mark.multiprocess
def test_the_diffusers_lora_loads_onto_the_source_and_equals_the_merged_export(
    lora_run: dict[str, Any],
) -> None:
    from diffusers import WanPipeline, WanTransformer3DModel

    adapter = Path(lora_run["adapter"])
    assert adapter == lora_run["root"] / "run" / "diffusers_lora"
    merged = WanTransformer3DModel.from_pretrained(Path(lora_run["export"]) / "transformer")
    pipe = WanPipeline.from_pretrained(lora_run["source"])
    g = torch.Generator().manual_seed(3)
    lat, text = torch.randn(2, 16, 3, 4, 6, generator=g), torch.randn(2, 5, 32, generator=g)
    ts = torch.tensor([200.0, 700.0])
    with torch.no_grad():
        base = pipe.transformer(lat, ts, text, return_dict=False)[0]
        pipe.load_lora_weights(adapter)
        loaded = pipe.transformer(lat, ts, text, return_dict=False)[0]
        want = merged.eval()(lat, ts, text, return_dict=False)[0]
    assert (loaded - want).abs().max() < 1e-5
    assert (want - base).abs().max() > 1e-3  # the adapters changed the model


def test_lora_keys_are_checked() -> None:
    from longboat.core.config.compose import compose_experiment

    with pytest.raises(ConfigError) as err:
        compose_experiment("quickstart", ["lora.enabled=true", "lora.targets=[to_q]"],
                           stack="diffusion")  # fmt: skip
    assert err.value.keys == ["lora.targets"]
    with pytest.raises(ConfigError) as err:
        compose_experiment("quickstart", ["export.adapter_dir=/tmp/x"], stack="diffusion")
    assert err.value.keys == ["export.adapter_dir"]


@pytest.mark.multiprocess
def test_a_flux_lora_loads_onto_the_source_and_equals_the_merged_export(
    tmp_path: Path,
) -> None:
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from longboat.diffusion.models.common.patches import patchify
    from longboat.diffusion.tiny_pipelines import build_tiny_pipeline

    source = build_tiny_pipeline("flux", tmp_path / "tiny_flux")
    overrides = [
        f"output_dir={tmp_path / 'run'}",
        f"data.out_dir={tmp_path / 'data'}",
        "model=flux_tiny",
        "model.overrides={}",
        f"model.init_from={source}",
        "data.patch_size=[1,2,2]",
        "data.shapes=[[1,8,8]]",
        "data.num_samples=8",
        "data.num_eval_samples=0",
        "train.micro_batch_size=4",
        "train.steps=2",
        "train.eval_every=0",
        "optim.lr=5e-2",
        "optim.schedule.warmup_steps=0",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.every_steps=0",
        "diffusion.preview=false",
        "lora.enabled=true",
        "lora.rank=2",
        "lora.alpha=4",
    ]
    run = run_multiprocess(_worker, 1, overrides, timeout=400)[0]
    adapters = [k for k in run["before"] if k.endswith("lora_A")]
    assert any(k.startswith("single_blocks.") and ".linear_fc2." in k for k in adapters)
    merged = FluxTransformer2DModel.from_pretrained(Path(run["export"]) / "transformer")
    pipe = FluxPipeline.from_pretrained(source)
    g = torch.Generator().manual_seed(4)
    lat, text = torch.randn(2, 16, 1, 6, 8, generator=g), torch.randn(2, 5, 32, generator=g)
    pooled = torch.randn(2, 32, generator=g)
    ids = torch.zeros(3, 4, 3)
    ids[..., 1] = torch.arange(3)[:, None]
    ids[..., 2] = torch.arange(4)[None, :]
    inputs = {
        "hidden_states": patchify(lat, (1, 2, 2)),
        "encoder_hidden_states": text,
        "pooled_projections": pooled,
        "timestep": torch.tensor([0.25, 0.75]),
        "img_ids": ids.reshape(-1, 3),
        "txt_ids": torch.zeros(5, 3),
        "return_dict": False,
    }
    with torch.no_grad():
        base = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(run["adapter"])
        loaded = pipe.transformer(**inputs)[0]
        want = merged.eval()(**inputs)[0]
    assert (loaded - want).abs().max() < 1e-5
    assert (want - base).abs().max() > 1e-3
