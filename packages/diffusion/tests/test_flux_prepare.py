"""``data prepare`` for FLUX from raw images with a (tiny random) FLUX pipeline's VAE, T5 and
CLIP: latents, T5 states and CLIP pooled embeddings equal encoding directly as the FLUX
pipeline does, and a FLUX run trains on them, its pooled-text projection learning from
the stored CLIP embeddings."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import longboat.diffusion.models.flux.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.distributed import run_multiprocess

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

CAPTIONS = ["a red square on grey", "a blue stripe", "a green dot", "waves at night"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from PIL import Image

    from longboat.diffusion.data.prepare import prepare_latents
    from longboat.diffusion.data.schema import PrepareConfig
    from longboat.diffusion.tiny_pipelines import build_tiny_pipeline

    root = tmp_path_factory.mktemp("flux_prepare")
    source = build_tiny_pipeline("flux", root / "tiny_flux", texts=CAPTIONS)
    rng = np.random.default_rng(0)
    (root / "images").mkdir()
    for i, caption in enumerate(CAPTIONS):
        size = (40, 48, 3) if i % 2 else (48, 36, 3)
        Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8)).save(
            root / "images" / f"{i}.png"
        )
        (root / "images" / f"{i}.txt").write_text(caption)
    cfg = PrepareConfig(
        input=str(root / "images"), out=str(root / "latents"), model_dir=str(source),
        height=32, width=32, num_frames=1, fps=None, dtype="float32",
        text_encoder_dtype="float32", device="cpu",
    )  # fmt: skip
    prepare_latents(cfg)
    return {"root": root, "source": source, "cfg": cfg}


def test_prepare_equals_encoding_as_the_flux_pipeline_does(prepared: dict[str, Any]) -> None:
    from diffusers import FluxPipeline

    from longboat.diffusion.data.dataset import LatentDataset
    from longboat.diffusion.data.empty_caption import read_empty_caption_parts
    from longboat.diffusion.data.media import load_clip

    data = LatentDataset([str(prepared["root"] / "latents")])
    assert len(data) == 4 and data.pooled_dim == 32 and data.text_dim == 32
    pipe = FluxPipeline.from_pretrained(prepared["source"])
    vae = pipe.vae
    for i in range(4):
        s = data[i]
        src = prepared["root"] / "images" / s["metadata"]["source"]
        frames = load_clip(src, targets=[(32, 32)], num_frames=1, fps=None, temporal=1).frames
        x = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        with torch.no_grad():
            z = vae.encode(x).latent_dist.mean
            want = (z - vae.config.shift_factor) * vae.config.scaling_factor
            ids = pipe.tokenizer_2(s["caption"], return_tensors="pt").input_ids
            text = pipe.text_encoder_2(ids).last_hidden_state[0]
            _, pooled, _ = pipe.encode_prompt(s["caption"], prompt_2=None)
        assert s["latents"].shape == (16, 1, 16, 16)
        assert torch.allclose(s["latents"][:, 0], want[0], atol=1e-5)
        assert torch.allclose(s["text_embeds"], text, atol=1e-5)
        assert torch.allclose(s["pooled_embeds"], pooled[0], atol=1e-5)
    empty = read_empty_caption_parts(prepared["root"] / "latents")
    with torch.no_grad():
        _, pooled_empty, _ = pipe.encode_prompt("", prompt_2=None)
    assert torch.allclose(empty["pooled_embeds"], pooled_empty[0], atol=1e-5)


def test_flux_prepare_refuses_video_lengths(prepared: dict[str, Any]) -> None:
    import dataclasses

    from longboat.core.config.errors import ConfigError
    from longboat.diffusion.data.prepare import prepare_latents

    cfg = dataclasses.replace(prepared["cfg"], num_frames=5, out=str(prepared["root"] / "x"))
    with pytest.raises(ConfigError) as err:
        prepare_latents(cfg)
    assert err.value.keys == ["num_frames"]


def _worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import Trainer, typed_config
    from longboat.diffusion.train.training import build_training

    cfg = typed_config(compose_experiment("finetune", overrides, stack="diffusion"))
    training = build_training(cfg)
    model = training.step_fn.model
    try:
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        result = Trainer(cfg, training).fit()
        moved = [k for k, v in model.named_parameters() if not torch.equal(v, before[k])]
        return {"moved": moved, "losses": result.losses, "preview": result.extra.get("preview")}
    finally:
        training.close()


@pytest.mark.multiprocess
def test_flux_trains_on_prepared_images_with_their_pooled_embeddings(
    prepared: dict[str, Any],
) -> None:
    root = prepared["root"]
    overrides = [
        f"output_dir={root / 'run'}",
        "model=flux_tiny",
        f"model.init_from={prepared['source']}",
        f"data.paths=[{root / 'latents'}]",
        "data.eval_paths=[]",
        "data.caption_dropout=0.5",
        "train.micro_batch_size=2",
        "train.steps=2",
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
    run = run_multiprocess(_worker, 1, overrides, timeout=400)[0]
    assert len(run["losses"]) == 2 and all(np.isfinite(run["losses"]))
    # the stored CLIP embeddings reach the pooled-text projection (zeros would not move it)
    assert "pooled_embedder.linear_1.weight" in run["moved"]
    assert run["preview"] and run["preview"].endswith(".png")
