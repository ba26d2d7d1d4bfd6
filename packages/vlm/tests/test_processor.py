"""Our Qwen2-VL processor == transformers' ``Qwen2VLImageProcessorPil`` (bit-exact).

Images: the same PIL bicubic resize and the same float ops, so ``pixel_values`` must be
identical (tolerance 0). transformers' video processor imports torchvision, which this
environment lacks; videos are checked against the image processor (a video of identical
frames is an image repeated over time) and against the frame-count / size formulas.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)

from longboat.vlm.data.processor import (
    QwenVisionProcessor,
    VisionProcessorConfig,
    sample_frame_indices,
)


def _image(h: int, w: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A deterministic image with smooth structure plus noise (resampling sees both)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)), (xx + yy) % 256], -1)
    noisy = np.clip(base + rng.integers(-40, 41, (h, w, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(noisy)
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8))
        img = img.copy()
        img.putalpha(alpha)
    elif mode != "RGB":
        img = img.convert(mode)
    return img


IMAGES = {
    "landscape": (224, 336, "RGB"),
    "upscaled_to_min_pixels": (37, 50, "RGB"),  # 37*50 < 56*56
    "downscaled_by_max_pixels": (1500, 900, "RGB"),  # 1.35 MP > 28*28*1280
    "thin": (61, 997, "RGB"),
    "rgba": (97, 130, "RGBA"),
    "gray": (150, 90, "L"),
}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: tuple[str, str]) -> None:
    grid, pixels = keys
    assert a[grid].tolist() == b[grid].tolist()
    assert a[pixels].dtype == b[pixels].dtype == torch.float32
    assert a[pixels].shape == b[pixels].shape
    diff = (a[pixels] - b[pixels]).abs().max().item()
    assert diff == 0.0, f"max abs diff {diff:.3g}"


@pytest.mark.parametrize("name", list(IMAGES))
def test_image_matches_transformers(name: str) -> None:
    h, w, mode = IMAGES[name]
    img = _image(h, w, seed=len(name), mode=mode)
    want = Qwen2VLImageProcessorPil()(images=[img], return_tensors="pt")
    got = QwenVisionProcessor().preprocess_images([img])
    _equal(got, want, ("image_grid_thw", "pixel_values"))
    grid_h, grid_w = want["image_grid_thw"][0, 1:].tolist()
    area = grid_h * grid_w * 14 * 14
    if name.startswith("upscaled"):
        assert area >= 56 * 56 and h * w < 56 * 56
    if name.startswith("downscaled"):
        assert area <= 28 * 28 * 1280 < h * w


def test_batch_of_arrays_and_custom_pixels_match_transformers() -> None:
    hf_config = {
        "min_pixels": 4 * 28 * 28, "max_pixels": 120 * 28 * 28, "patch_size": 14,
        "temporal_patch_size": 2, "merge_size": 2,
    }  # fmt: skip
    images = [
        np.array(_image(300, 200, seed=1)),  # uint8 [H, W, 3]
        np.array(_image(40, 41, seed=2).convert("L"))[..., None],  # uint8 [H, W, 1]
        _image(512, 512, seed=3),
    ]
    want = Qwen2VLImageProcessorPil(**hf_config)(images=images, return_tensors="pt")
    got = QwenVisionProcessor(VisionProcessorConfig.from_hf(hf_config)).preprocess_images(images)
    _equal(got, want, ("image_grid_thw", "pixel_values"))


def _video_processor() -> QwenVisionProcessor:
    return QwenVisionProcessor(
        VisionProcessorConfig(video_min_pixels=56 * 56, video_max_pixels=28 * 28 * 64)
    )


def test_static_video_equals_the_image_processor() -> None:
    frame = _image(123, 321, seed=7)
    want = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64)(
        images=[frame], return_tensors="pt"
    )
    got = _video_processor().preprocess_videos([[frame, frame]])
    assert got["video_grid_thw"].tolist() == want["image_grid_thw"].tolist()
    assert torch.equal(got["pixel_values_videos"], want["pixel_values"])


def test_video_pads_the_last_frame_and_keeps_frame_order() -> None:
    frames = [_image(100, 140, seed=s) for s in range(3)]
    clip = np.stack([np.array(f) for f in frames])  # [T, H, W, C] uint8
    proc = _video_processor()
    got = proc.preprocess_videos([clip])
    assert torch.equal(
        got["pixel_values_videos"], proc.preprocess_videos([frames])["pixel_values_videos"]
    )
    t, gh, gw = got["video_grid_thw"][0].tolist()
    assert t == 2  # 3 frames -> 4 with the last repeated
    rows = got["pixel_values_videos"].view(t, gh * gw, 3, 2, 14, 14)
    image = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    per_frame = [
        image(images=[f], return_tensors="pt")["pixel_values"].view(gh * gw, 3, 2, 14, 14)[:, :, 0]
        for f in frames
    ]
    for slot, k in ((0, 0), (1, 0), (2, 1), (3, 1)):
        src = min(slot, 2)  # the fourth frame is a copy of the third
        assert torch.equal(rows[k, :, :, slot % 2], per_frame[src]), slot


def test_video_size_follows_transformers_formula() -> None:
    cfg = VisionProcessorConfig()  # transformers' Qwen2-VL video defaults
    proc = QwenVisionProcessor(cfg)
    for h, w in ((360, 640), (1080, 1920), (50, 60)):
        assert proc.video_size(16, h, w) == hf_smart_resize(
            h, w, factor=28, min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768
        )
    capped = QwenVisionProcessor(
        VisionProcessorConfig(cap_pixels_per_frame=True, max_video_tokens=4096)
    )
    frames = 64
    budget = max(
        min(28 * 28 * 768, int(4096 * 28 * 28 * 0.9) * 2 // frames), int(128 * 28 * 28 * 1.05)
    )
    assert capped.video_size(frames, 1080, 1920) == hf_smart_resize(
        1080, 1920, factor=28, min_pixels=128 * 28 * 28, max_pixels=budget
    )
    assert capped.video_size(frames, 1080, 1920) != proc.video_size(frames, 1080, 1920)


def test_frame_sampling() -> None:
    cfg = VisionProcessorConfig()
    assert sample_frame_indices(10, cfg) == list(range(10))
    # num_frames rounds to the temporal patch: 5 -> 4 (round half to even) of 10.
    assert sample_frame_indices(10, cfg, num_frames=5) == [0, 2, 5, 7]
    # 30 frames at 30 fps sampled at 2 fps -> 2 frames, raised to min_frames=4.
    assert sample_frame_indices(30, cfg, fps=2, video_fps=30) == [0, 7, 15, 22]
    # 300 frames at 30 fps at 1 fps -> 10 frames.
    want = [math.floor(i * 30.0) for i in range(10)]
    assert sample_frame_indices(300, cfg, fps=1, video_fps=30) == want
    with pytest.raises(ValueError, match="num_frames or fps"):
        sample_frame_indices(10, cfg, num_frames=4, fps=1)
    with pytest.raises(ValueError, match="cannot sample 12"):
        sample_frame_indices(10, cfg, num_frames=12)
    proc = _video_processor()
    out = proc.preprocess_videos([[_image(64, 64, seed=s) for s in range(9)]], num_frames=4)
    assert out["video_grid_thw"][0, 0].item() == 2
