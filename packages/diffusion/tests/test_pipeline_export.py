"""Runs with a source pipeline: Wan from ``model.init_from=<pipeline>`` (latents prepared with
that pipeline's encoders), FLUX from ``diffusion.pipeline_from``.

The export is a whole diffusers pipeline: ``DiffusionPipeline.from_pretrained`` loads it and
samples, its transformer holds the trained weights and its other components the source's.
The previews (every step and at the end) are decoded by the pipeline's VAE exactly as the
diffusers pipelines decode, with the caption under each sample."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import longboat.diffusion.models.wan.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.distributed import run_multiprocess

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

CAPTIONS = ["a red square on grey", "a blue stripe on white", "a green dot", "waves"]
STEPS = 2


def _run_worker(rank: int, world: int, experiment: str, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import Trainer, typed_config
    from longboat.diffusion.train.training import build_training

    cfg = typed_config(compose_experiment(experiment, overrides, stack="diffusion"))
    training = build_training(cfg)
    try:
        result = Trainer(cfg, training).fit()
        trained = {k: v.detach().clone() for k, v in training.step_fn.model.named_parameters()}
        return {
            "losses": result.losses,
            "export": str(result.export_dir),
            "trained": trained,
            "preview": result.extra.get("preview"),
        }
    finally:
        training.close()


def _common(out: Path) -> list[str]:
    return [
        f"output_dir={out}",
        "train.micro_batch_size=2",
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


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert names and names == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def _check_transformer(export: Path, family: str, trained: dict[str, torch.Tensor]) -> None:
    """The export's transformer/ holds the trained model's weights exactly."""
    import importlib

    from safetensors.torch import load_file

    from longboat.diffusion.models.registry import get_family

    impl = get_family(family).load()
    io = importlib.import_module(f"longboat.diffusion.models.{family}.diffusers")
    theirs = load_file(export / "transformer" / "diffusion_pytorch_model.safetensors")
    full = io.from_diffusers_state_dict(theirs, impl.read_config(export))
    assert set(full) == set(trained)
    for k, v in trained.items():
        assert torch.equal(full[k], v), k


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from PIL import Image

    from longboat.diffusion.data.prepare import prepare_latents
    from longboat.diffusion.data.schema import PrepareConfig
    from longboat.diffusion.tiny_pipelines import build_tiny_pipeline

    root = tmp_path_factory.mktemp("wan_pipeline")
    source = build_tiny_pipeline("wan", root / "tiny_wan", texts=CAPTIONS)
    rng = np.random.default_rng(0)
    (root / "images").mkdir()
    for i, caption in enumerate(CAPTIONS):
        img = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(img).save(root / "images" / f"{i}.png")
        (root / "images" / f"{i}.txt").write_text(caption)
    prepare_latents(
        PrepareConfig(
            input=str(root / "images"),
            out=str(root / "latents"),
            model_dir=str(source),
            height=32,
            width=32,
            num_frames=1,
            dtype="float32",
            text_encoder_dtype="float32",
            device="cpu",
        ),
        progress=False,
    )
    overrides = [
        *_common(root / "run"),
        f"model.init_from={source}",
        f"data.paths=[{root / 'latents'}]",
        "data.eval_paths=[]",
        "diffusion.preview_every=1",
    ]
    out = run_multiprocess(_run_worker, 1, "finetune", overrides, timeout=400)[0]
    return out | {"source": source, "root": root}


@pytest.mark.multiprocess
def test_wan_export_is_a_pipeline_that_loads_and_samples(wan_run: dict[str, Any]) -> None:
    from diffusers import DiffusionPipeline, WanPipeline

    export, source = Path(wan_run["export"]), wan_run["source"]
    index = json.loads((export / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    for part in ("vae", "text_encoder", "tokenizer", "scheduler"):
        _same_files(source / part, export / part)
    _check_transformer(export, "wan", wan_run["trained"])
    pipe = DiffusionPipeline.from_pretrained(export)
    assert isinstance(pipe, WanPipeline)
    frames = pipe(
        "a red square on grey",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=1.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert frames.shape == (1, 5, 32, 32, 3) and np.isfinite(frames).all()


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from longboat.diffusion.tiny_pipelines import build_tiny_pipeline

    root = tmp_path_factory.mktemp("flux_pipeline")
    source = build_tiny_pipeline("flux", root / "tiny_flux", texts=CAPTIONS)
    overrides = [
        *_common(root / "run"),
        f"data.out_dir={root / 'data'}",
        "model=flux_tiny",
        "model.overrides={}",
        "data.patch_size=[1,2,2]",
        "data.shapes=[[1,8,8]]",
        "data.num_samples=8",
        "data.num_eval_samples=2",
        f"diffusion.pipeline_from={source}",
    ]
    out = run_multiprocess(_run_worker, 1, "quickstart", overrides, timeout=400)[0]
    return out | {"source": source}


@pytest.mark.multiprocess
def test_flux_export_is_a_pipeline_that_loads_and_samples(flux_run: dict[str, Any]) -> None:
    from diffusers import DiffusionPipeline, FluxPipeline

    export, source = Path(flux_run["export"]), flux_run["source"]
    index = json.loads((export / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    parts = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")
    for part in parts:
        _same_files(source / part, export / part)
    _check_transformer(export, "flux", flux_run["trained"])
    pipe = DiffusionPipeline.from_pretrained(export)
    assert isinstance(pipe, FluxPipeline)
    images = pipe(
        "a red square on grey",
        height=32,
        width=32,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert images.shape == (1, 32, 32, 3) and np.isfinite(images).all()


def test_a_pipeline_of_another_family_is_refused(tmp_path: Path) -> None:
    """``diffusion.pipeline_from`` naming a FLUX pipeline for a Wan run stops the compose
    with the key named."""
    from longboat.core.config.compose import compose_experiment
    from longboat.core.config.errors import ConfigError
    from longboat.diffusion.tiny_pipelines import build_tiny_pipeline

    source = build_tiny_pipeline("flux", tmp_path / "tiny_flux")
    with pytest.raises(ConfigError) as err:
        compose_experiment("quickstart", [f"diffusion.pipeline_from={source}"], stack="diffusion")
    text = str(err.value)
    assert "diffusion.pipeline_from" in text and "FluxTransformer2DModel" in text, text
    with pytest.raises(ConfigError, match=r"model_index\.json"):
        compose_experiment("quickstart", [f"diffusion.pipeline_from={tmp_path}"], stack="diffusion")


def _upscale(clip: np.ndarray, factor: int) -> np.ndarray:
    return clip.repeat(factor, axis=1).repeat(factor, axis=2)


@pytest.mark.multiprocess
def test_wan_previews_are_decoded_by_the_vae_with_captions(wan_run: dict[str, Any]) -> None:
    """Every step's preview is a PNG grid (the data are images): each reference clip is the
    VAE's decode of the dataset sample, not the latents' colour view, and the caption is
    written under its pair."""
    from PIL import Image

    from longboat.diffusion.data.dataset import LatentDataset
    from longboat.diffusion.data.preview import caption_strip, latents_to_rgb
    from longboat.diffusion.data.vae_decode import LatentDecoder
    from longboat.diffusion.train.preview import pick_captions

    run_dir = wan_run["root"] / "run" / "preview"
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "step_00000001.png",
        "step_00000002.png",
    ]
    assert wan_run["preview"] == str(run_dir / "step_00000002.png")
    sheet = np.asarray(Image.open(run_dir / "step_00000001.png").convert("RGB"))
    data = LatentDataset([str(wan_run["root"] / "latents")])
    decoder = LatentDecoder(wan_run["source"] / "vae")
    picked = pick_captions(data, 2)
    # 32x32 pixels a clip, scaled x3 to the sheet's 96 px; pairs of 96 + 2 + 96 = 194 wide
    cell_w, captions = 194, [data[i]["caption"] for i in picked]
    lines = max(len(caption_strip(c, cell_w)) for c in captions)
    for k, i in enumerate(picked):
        x = k * (cell_w + 2)
        ref = _upscale(decoder.decode(data[i]["latents"]), 3)[0]
        got = sheet[:96, x + 98 : x + 194].astype(int)
        assert np.abs(got - ref).max() <= 1
        colour_view = _upscale(latents_to_rgb(data[i]["latents"]), 24)[0]
        assert np.abs(got - colour_view.astype(int)).max() > 30
        strip = caption_strip(captions[k], cell_w, (lines - 4) // 12)
        assert np.array_equal(sheet[96 : 96 + strip.shape[0], x : x + cell_w], strip)
        assert (strip < 128).any()  # the caption's text is there


def test_decoder_equals_the_diffusers_pipelines_decode(tmp_path: Path) -> None:
    """``LatentDecoder`` turns dataset latents into the pixels WanPipeline / FluxPipeline make
    of the same latents (their own denormalisation, VAE decode and post-processing)."""
    from diffusers import DiffusionPipeline

    from longboat.diffusion.data.vae_decode import LatentDecoder
    from longboat.diffusion.tiny_pipelines import build_tiny_pipeline

    g = torch.Generator().manual_seed(0)
    for family in ("wan", "flux"):
        source = build_tiny_pipeline(family, tmp_path / family)
        pipe = DiffusionPipeline.from_pretrained(source)
        vae = pipe.vae
        ours = LatentDecoder(source / "vae")
        if family == "wan":
            z = torch.randn(16, 2, 4, 4, generator=g)
            mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
            std_inv = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
            with torch.no_grad():
                video = vae.decode(z[None] / std_inv + mean, return_dict=False)[0]
            want = pipe.video_processor.postprocess_video(video, output_type="np")[0]
        else:
            z = torch.randn(16, 1, 8, 8, generator=g)
            lat = z[:, 0][None] / vae.config.scaling_factor + vae.config.shift_factor
            with torch.no_grad():
                image = vae.decode(lat, return_dict=False)[0]
            want = pipe.image_processor.postprocess(image, output_type="np")
        got = ours.decode(z)
        assert got.shape == want.shape, (got.shape, want.shape)
        assert np.abs(got.astype(float) - np.round(want * 255)).max() <= 1
