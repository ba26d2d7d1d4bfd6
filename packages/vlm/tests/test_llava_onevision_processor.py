"""Our LLaVA-OneVision processor == transformers' ``LlavaOnevisionImageProcessorPil``
(bit-exact: tolerance 0), and its token counts == transformers' processor's rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)

from longboat.vlm.data.llava_processor import LlavaProcessorConfig, LlavaVisionProcessor
from longboat.vlm.models.llava_onevision.anyres import num_image_tokens
from longboat.vlm.models.llava_onevision.config import RELEASED_PINPOINTS

TINY = tuple((16 * r, 16 * c) for r in range(1, 4) for c in range(1, 4))


def _image(h: int, w: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)), (xx + yy) % 256], -1)
    img = Image.fromarray(np.clip(base + rng.integers(-40, 41, (h, w, 3)), 0, 255).astype(np.uint8))
    return img.convert(mode) if mode != "RGB" else img


def _pair(crop: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple:
    hf = LlavaOnevisionImageProcessorPil(
        size={"height": crop, "width": crop}, image_grid_pinpoints=[list(p) for p in pinpoints]
    )
    ours = LlavaVisionProcessor(
        LlavaProcessorConfig(crop_size=crop, patch_size=4, image_grid_pinpoints=pinpoints)
    )
    return hf, ours


def _check(hf_out: dict, ours: dict, sizes: list[tuple[int, int]]) -> None:
    views = ours["image_grid_thw"][:, 0].tolist()
    assert ours["image_grid_thw"][:, 1:].tolist() == hf_out["image_sizes"].tolist()
    want = torch.cat([hf_out["pixel_values"][i, :v] for i, v in enumerate(views)])
    assert ours["pixel_values"].dtype == want.dtype == torch.float32
    assert ours["pixel_values"].shape == want.shape
    assert torch.equal(ours["pixel_values"], want)
    # every view beyond an image's own is HF's batch padding (zeros)
    for i, v in enumerate(views):
        assert not hf_out["pixel_values"][i, v:].any()


@pytest.mark.parametrize("size", [(20, 37), (45, 47), (16, 16), (7, 50), (61, 12), (33, 33)])
def test_single_image_tiles_equal_transformers(size: tuple[int, int]) -> None:
    hf, ours = _pair(16, TINY)
    img = _image(*size, seed=sum(size))
    _check(hf([[img]], return_tensors="pt"), ours.preprocess_images([img]), [size])


def test_multi_image_sample_equal_transformers() -> None:
    """Two or more images in one sample: one padded square view each (mean colour)."""
    hf, ours = _pair(16, TINY)
    sizes = [(30, 13), (9, 21), (16, 40)]
    imgs = [_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    got = ours.preprocess_images(imgs)
    assert got["image_grid_thw"][:, 0].tolist() == [1, 1, 1]
    _check(hf([imgs], return_tensors="pt"), got, sizes)


def test_rgba_and_grey_equal_transformers() -> None:
    hf, ours = _pair(16, TINY)
    for mode in ("RGBA", "L"):
        img = _image(23, 30, seed=5, mode=mode)
        _check(hf([[img]], return_tensors="pt"), ours.preprocess_images([img]), [(23, 30)])


def test_released_geometry_equal_transformers() -> None:
    """384-pixel crops and the released pinpoints on a real-sized image."""
    hf, ours = _pair(384, RELEASED_PINPOINTS)
    img = _image(500, 900, seed=3)
    _check(hf([[img]], return_tensors="pt"), ours.preprocess_images([img]), [(500, 900)])


def _hf_token_count(h: int, w: int, grid: int, crop: int, pinpoints: list, ratio: str) -> int:
    """transformers' ``LlavaOnevisionProcessor._get_number_of_features`` on a stub."""
    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor,
    )

    stub = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    stub.num_image_tokens = grid * grid
    stub.vision_aspect_ratio = ratio
    stub.image_processor = type("P", (), {"image_grid_pinpoints": pinpoints})()
    return stub._get_number_of_features(h, w, crop, crop)


@pytest.mark.parametrize("ratio", ["anyres_max_9", "anyres_max_2"])
def test_token_counts_equal_transformers(ratio: str) -> None:
    rng = np.random.default_rng(0)
    pins = [list(p) for p in RELEASED_PINPOINTS]
    for h, w in rng.integers(20, 3000, (40, 2)).tolist():
        want = _hf_token_count(h, w, 27, 384, pins, ratio)
        got = num_image_tokens(
            h, w, tiled=True, grid=27, crop=384, pinpoints=RELEASED_PINPOINTS,
            vision_aspect_ratio=ratio,
        )  # fmt: skip
        assert got == want, (h, w)
