"""LLaVA-OneVision-style composed VLM == transformers' ``LlavaOnevisionForConditionalGeneration``
(CPU, fp32, tiny random weights, no downloads).

A tiny HF model (tiny SigLIP + tiny Qwen2) is built from our config and saved; longboat reads
the directory (architecture from config.json), loads it into a megatron gloo worker and
compares: the vision features (tower + projector + anyres packing) and the logits for text
only, one tiled image (unpadded columns), one large tiled image (the ``anyres_max_N``
shrink), two images of different sizes in one sample (one square view each), a video
(frame features pooled to half the grid, one newline), and a packed
row against each sample alone. Images go through transformers' own
``LlavaOnevisionImageProcessorPil`` and its outputs feed both models. The export is loaded
back by transformers and gives the same logits. Other decoder families (qwen3, llama3) are
composed from config, built and run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import LlavaOnevisionForConditionalGeneration
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)

from longboat.core.distributed import run_multiprocess
from longboat.vlm.data.llava_processor import LlavaProcessorConfig, LlavaVisionProcessor
from longboat.vlm.models.llava_onevision.model import (
    flavor,
    num_video_tokens,
    read_hf_config,
    to_hf_config,
)

TOL = 1e-4  # max abs difference vs transformers (fp32)
# anyres_max_4: a 3x3-tile image's 12x12 feature map is shrunk to 8x8, a 2x2-tile one is not.
CFG = dataclasses.replace(flavor("tiny"), vision_aspect_ratio="anyres_max_4")
IMG = CFG.image_token_id
CASES = ("text", "one_image", "large_image", "two_images", "video")
SIZES = {"one_image": [(20, 37)], "large_image": [(45, 47)], "two_images": [(30, 13), (9, 21)]}


def _image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _hf_processor() -> LlavaOnevisionImageProcessorPil:
    size = CFG.vision.image_size
    return LlavaOnevisionImageProcessorPil(
        size={"height": size, "width": size},
        image_grid_pinpoints=[list(p) for p in CFG.image_grid_pinpoints],
    )


def _ours_processor() -> LlavaVisionProcessor:
    return LlavaVisionProcessor(
        LlavaProcessorConfig(
            crop_size=CFG.vision.image_size,
            patch_size=CFG.vision.patch_size,
            image_grid_pinpoints=CFG.image_grid_pinpoints,
            vision_aspect_ratio=CFG.vision_aspect_ratio,
        )
    )


def _case(name: str, seed: int) -> dict[str, Any]:
    """HF's inputs (``hf``) and ours (``ours``) of one sample, from HF's processor."""
    g = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(0, 300, (n,), generator=g).tolist()

    if name == "text":
        ids = torch.tensor([text(21)])
        return {"hf": {"input_ids": ids}, "ours": {"input_ids": ids}}
    if name == "video":
        frames, s = 3, CFG.vision.image_size
        pv = torch.randn(1, frames, 3, s, s, generator=g)
        n = num_video_tokens(frames, CFG.vision.grid)
        ids = torch.tensor([text(4) + [CFG.video_token_id] * n + text(3)])
        return {
            "hf": {"input_ids": ids, "pixel_values_videos": pv},
            "ours": {
                "input_ids": ids,
                "pixel_values_videos": pv[0],
                "video_grid_thw": torch.tensor([[frames, s, s]]),
            },
        }
    images = [_image(h, w, seed + i) for i, (h, w) in enumerate(SIZES[name])]
    hf_px = _hf_processor()([images], return_tensors="pt")
    grids = [_ours_processor().image_grid(h, w, alone=len(images) == 1) for h, w in SIZES[name]]
    ids = text(4)
    for grid in grids:
        ids += [IMG] * _ours_processor().grid_tokens(grid) + text(3)
    input_ids = torch.tensor([ids])
    views = torch.cat([hf_px["pixel_values"][i, : grid[0]] for i, grid in enumerate(grids)])
    return {
        "hf": {
            "input_ids": input_ids,
            "pixel_values": hf_px["pixel_values"],
            "image_sizes": hf_px["image_sizes"],
            "batch_num_images": hf_px["batch_num_images"],
        },
        "ours": {
            "input_ids": input_ids,
            "pixel_values": views,
            "image_grid_thw": torch.tensor(grids),
        },
    }


def _hf_logits(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def _save_random_hf(cfg: Any, out: Path) -> Path:
    hf_cfg = to_hf_config(cfg)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a dropped one shows
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.08)
            if "norm" in name:
                p.add_(1.0)
            if "post_layernorm" in name:  # not part of a LLaVA tower's output
                p.fill_(1.0 if name.endswith("weight") else 0.0)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_random_hf(CFG, tmp_path_factory.mktemp("llava_onevision_tiny"))


@pytest.fixture(scope="module")
def reference(hf_dir: Path) -> dict[str, torch.Tensor]:
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(
        hf_dir, attn_implementation="sdpa"
    ).eval()
    out = {}
    for i, name in enumerate(CASES):
        batch = _case(name, i)["hf"]
        out[name] = _hf_logits(model, batch)
        if name not in ("text", "video"):
            with torch.no_grad():
                feats = model.model.get_image_features(
                    batch["pixel_values"], batch["image_sizes"],
                    batch_num_images=batch["batch_num_images"], return_dict=True,
                ).pooler_output  # fmt: skip
            out[f"{name}/features"] = torch.cat(list(feats))
    return out


def _worker(rank: int, world: int, hf_dir: Path, export: Path | None) -> dict[str, Any]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.vlm.models.llava_onevision.model import build, load_hf, save_hf

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"))
    try:
        model = build(cfg)
        load_hf(model, cfg, hf_dir)
        model.eval()
        out: dict[str, Any] = {}
        with torch.no_grad():
            for i, name in enumerate(CASES):
                batch = _case(name, i)["ours"]
                out[name] = model(**batch)
                if name not in ("text", "video"):
                    out[f"{name}/features"] = model.vision(
                        batch["pixel_values"], batch["image_grid_thw"]
                    )
            a, b = _case("one_image", 1)["ours"], _case("two_images", 3)["ours"]
            la, lb = a["input_ids"].shape[1], b["input_ids"].shape[1]
            packed = {
                "input_ids": torch.cat([a["input_ids"], b["input_ids"]], dim=1),
                "pixel_values": torch.cat([a["pixel_values"], b["pixel_values"]]),
                "image_grid_thw": torch.cat([a["image_grid_thw"], b["image_grid_thw"]]),
            }
            out["packed"] = model(**packed, cu_seqlens=[0, la, la + lb])
        if export is not None:
            save_hf(model, cfg, export)
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_logits_match_transformers(
    hf_dir: Path, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    export = tmp_path / "export"
    (got,) = run_multiprocess(_worker, 1, hf_dir, export, timeout=300)
    for key, want in reference.items():
        diff = (got[key] - want).abs().max().item()
        assert got[key].shape == want.shape, key
        assert diff < TOL, f"{key}: max |d| {diff:.2e} >= {TOL}"
    alone = torch.cat([reference["one_image"], reference["two_images"]], dim=1)
    diff = (got["packed"] - alone).abs().max().item()
    assert diff < TOL, f"packed: max |dlogit| {diff:.2e} vs each sample alone"
    reloaded = LlavaOnevisionForConditionalGeneration.from_pretrained(
        export, attn_implementation="sdpa"
    ).eval()
    for i, name in enumerate(CASES):
        diff = (_hf_logits(reloaded, _case(name, i)["hf"]) - reference[name]).abs().max().item()
        assert diff < TOL, f"export, {name}: max |dlogit| {diff:.2e} after the round trip"


def test_config_round_trip(hf_dir: Path) -> None:
    """config.json -> ours -> HF config -> ours is the identity."""
    cfg = read_hf_config(hf_dir)
    assert cfg.architecture() == CFG.architecture()
    assert read_hf_config(to_hf_config(cfg).to_dict()) == cfg


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "language",
    [
        {"name": "qwen3", "flavor": "tiny", "vocab_size": 384},
        {"name": "llama3", "flavor": "tiny", "vocab_size": 384, "hidden_size": 48},
    ],
    ids=["qwen3", "llama3"],
)
def test_other_decoders_match_transformers(language: dict, tmp_path: Path) -> None:
    """The same parity with a qwen3 or llama3 decoder composed in: ``read_hf_config`` maps
    ``text_config.model_type`` to core's family."""
    from longboat.vlm.models.llava_onevision.config import compose

    cfg = compose(CFG, language=language)
    hf_dir = _save_random_hf(cfg, tmp_path / "hf")
    assert read_hf_config(hf_dir).architecture() == cfg.architecture()
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(
        hf_dir, attn_implementation="sdpa"
    ).eval()
    (got,) = run_multiprocess(_worker, 1, hf_dir, None, timeout=300)
    for i, name in enumerate(CASES):
        diff = (got[name] - _hf_logits(model, _case(name, i)["hf"])).abs().max().item()
        assert diff < TOL, f"{language['name']}, {name}: max |dlogit| {diff:.2e} >= {TOL}"
