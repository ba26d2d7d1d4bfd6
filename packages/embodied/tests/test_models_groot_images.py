"""GR00T N1.6 frames resampled as Isaac-GR00T N1.6 does: OpenCV ``INTER_AREA`` and Pillow
``BICUBIC`` on uint8, and its processor's chain (albumentations ``SmallestMaxSize``, the
fractional crop, Eagle's final resize), equal to outputs written by OpenCV 4.11, Pillow 12.1
and albumentations 1.4.18 themselves (``test_data_isaac_images``), bit for bit."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from longboat.embodied.models import get_config
from longboat.embodied.models.common.image_preprocessing import (
    ImagePreprocessConfig,
    eagle_smart_resize,
    isaac_frames,
    isaac_sizes,
    preprocess_images,
)
from longboat.embodied.models.common.resample import area_resize, bicubic_resize

REFERENCE = Path(__file__).parent / "test_data_isaac_images" / "reference.npz"
# The cases of generate_with_opencv.py, in its order.
AREA = [
    ((24, 32), (12, 16)),
    ((30, 36), (10, 12)),
    ((47, 61), (25, 33)),
    ((23, 31), (40, 53)),
    ((30, 20), (22, 35)),
    ((53, 79), (56, 83)),
]
BICUBIC = [((56, 83), (56, 84)), ((47, 61), (28, 56)), ((61, 47), (84, 28)), ((40, 40), (33, 71))]
CHAIN = [
    ((64, 96), 56),
    ((48, 48), 56),
    ((90, 120), 56),
    ((75, 50), 56),
    ((480, 640), 256),
    ((256, 256), 256),
    ((224, 224), 256),
    ((720, 1280), 256),
]


def pattern(h: int, w: int, seed: int) -> np.ndarray:
    """The generator's reproducible uint8 [h, w, 3] frame (same formula)."""
    i, j, c = np.meshgrid(np.arange(h), np.arange(w), np.arange(3), indexing="ij")
    v = (i * 31 + j * 17 + c * 101 + seed * 7) ** 2 + i * j * 13
    img = ((v * 2654435761) >> 13 & 255).astype(np.uint8)
    img[: h // 2, : w // 2] = img[: h // 2, : w // 2] // 64 * 64
    return img


def chw(img: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(img).permute(2, 0, 1)[None].contiguous()


def hwc(x: torch.Tensor) -> np.ndarray:
    return x[0].permute(1, 2, 0).numpy()


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(REFERENCE) as data:
        return {k: data[k] for k in data.files}


def assert_reference(reference: dict[str, np.ndarray], name: str, ours: np.ndarray) -> None:
    """Equal to the stored output, or to its shape and sha256 where only those are stored."""
    if name in reference:
        want = reference[name]
        assert ours.shape == want.shape, name
        diff = np.abs(ours.astype(int) - want.astype(int))
        assert diff.max() == 0, f"{name}: {(diff > 0).sum()} values differ, by up to {diff.max()}"
        return
    assert ours.shape == tuple(reference[f"{name}_shape"]), name
    digest = hashlib.sha256(np.ascontiguousarray(ours).tobytes()).digest()
    assert digest == reference[f"{name}_sha256"].tobytes(), name


def test_reference_versions(reference) -> None:
    assert str(reference["versions"]) == "opencv 4.11.0, Pillow 12.1.1, albumentations 1.4.18"


@pytest.mark.parametrize("case", range(len(AREA)))
def test_area_resize_equals_opencv_inter_area(reference, case: int) -> None:
    (h, w), size = AREA[case]
    assert_reference(reference, f"area_{case}", hwc(area_resize(chw(pattern(h, w, case)), size)))


def test_torch_area_equals_inter_area_only_for_integer_factors_other_than_two() -> None:
    """``F.interpolate(mode="area")`` rounded half to even is OpenCV's 3x3 block mean; 2x2
    rounds ties up in OpenCV; a fractional factor weighs partial pixels by their overlap in
    OpenCV and not in torch's adaptive pooling."""
    img = chw(pattern(30, 36, 1))

    def torch_area(size):
        out = F.interpolate(img.float(), size=size, mode="area")
        return out.round().clamp(0, 255).to(torch.uint8)

    assert torch.equal(area_resize(img, (10, 12)), torch_area((10, 12)))
    assert not torch.equal(area_resize(img, (15, 18)), torch_area((15, 18)))  # 2x2 ties
    assert not torch.equal(area_resize(img, (13, 17)), torch_area((13, 17)))


@pytest.mark.parametrize("case", range(len(BICUBIC)))
def test_bicubic_resize_equals_pillow(reference, case: int) -> None:
    (h, w), size = BICUBIC[case]
    img = pattern(h, w, case)
    ours = hwc(bicubic_resize(chw(img), size))
    assert_reference(reference, f"bicubic_{case}", ours)
    # The installed Pillow, one axis per call (Pillow 12 resamples columns first; Pillow 13
    # may take rows first when they shrink more, so one call of it can differ).
    cols = Image.fromarray(img).resize((size[1], h), Image.BICUBIC)
    assert np.array_equal(ours, np.asarray(cols.resize((size[1], size[0]), Image.BICUBIC)))


@pytest.mark.parametrize("case", range(len(CHAIN)))
def test_isaac_eval_chain_equals_isaac_processor(reference, case: int) -> None:
    """The eval frames of Isaac-GR00T N1.6's processor (shortest side, centred 0.95 crop,
    shortest side back, Eagle's smart_resize with Pillow's bicubic), 480x640 -> 252x336."""
    (h, w), edge = CHAIN[case]
    cfg = ImagePreprocessConfig(
        resize_shortest=edge, crop_fraction=0.95, multiple_of=28, resample="isaac"
    )
    ours = hwc(isaac_frames(chw(pattern(h, w, case)), cfg, train=False))
    assert_reference(reference, f"chain_{case}", ours)
    assert ours.shape[:2] == cfg.output_size(h, w)
    if (h, w) == (480, 640):
        assert isaac_sizes(h, w, cfg) == [(256, 341), (243, 323), (256, 340), (252, 336)]


def test_eagle_smart_resize_rounds_each_side_to_the_nearest_multiple() -> None:
    assert eagle_smart_resize(256, 340, 28) == (252, 336)
    assert eagle_smart_resize(256, 384, 28) == (252, 392)  # 13.7 -> 14: rounded, not floored
    assert eagle_smart_resize(70, 70, 28) == (56, 56)  # 2.5 -> 2: Python's round
    assert eagle_smart_resize(20, 20, 28) == (56, 56)  # under 4 * 28**2 pixels: scaled up


def test_training_crop_is_one_offset_per_sample_for_all_its_cameras() -> None:
    """Training draws one integer offset per sample (Isaac-GR00T replays the first view's
    crop on the others); each frame equals the eval chain with the crop at that offset."""
    cfg = get_config("groot_n1_6", "tiny", {}).image
    assert cfg.resample == "isaac"
    gen = torch.Generator().manual_seed(0)
    cams = [chw(pattern(64, 96, 7)), chw(pattern(64, 96, 8))]
    images = torch.stack([torch.cat(cams), torch.cat(cams)])  # [2 samples, 2 cameras, ...]
    out = isaac_frames(images, cfg, train=True, generator=gen)
    first, crop, back, final = isaac_sizes(64, 96, cfg)
    again = torch.Generator().manual_seed(0)
    tops = torch.randint(0, first[0] - crop[0] + 1, (2,), generator=again)
    lefts = torch.randint(0, first[1] - crop[1] + 1, (2,), generator=again)
    for s in range(2):
        for c in range(2):
            x = area_resize(cams[c], first)
            t, left = int(tops[s]), int(lefts[s])
            x = x[..., t : t + crop[0], left : left + crop[1]].contiguous()
            want = bicubic_resize(area_resize(x, back), final)
            assert torch.equal(out[s, c], want[0]), (s, c)
    assert (tops[0], lefts[0]) != (tops[1], lefts[1])  # seed 0 draws two offsets


def test_preprocess_normalises_as_the_eagle_processor() -> None:
    """(x - 127.5) / 127.5 of the uint8 chain (transformers fuses the 1/255 rescale into
    mean and std 0.5); float frames k / 255 give the same as uint8 k."""
    cfg = get_config("groot_n1_6", "tiny", {}).image
    frames = chw(pattern(64, 96, 3))
    pix = preprocess_images(frames, cfg, train=False)
    want = (isaac_frames(frames, cfg, train=False).float() - 127.5) / 127.5
    assert torch.equal(pix, want)
    assert torch.equal(preprocess_images(frames.float() / 255, cfg, train=False), pix)
