"""Video frames of the Qwen3-VL and LLaVA-OneVision processors == transformers' video
processors (``Qwen3VLVideoProcessor``, ``LlavaOnevisionVideoProcessor``; tolerance 0).

transformers' video processors need torchvision, which this workspace does not install, so
their outputs on the synthetic videos of ``QWEN3_CASES`` / ``LLAVA_CASES`` were written once
by transformers itself (``test_data_hf_video_artifacts/``, see its README) and are compared
here bit for bit: the sampled frame indices, the grids and ``pixel_values_videos``. The
pure functions of transformers' modules that import without torchvision (Qwen3-VL's
``smart_resize``, its ``sample_frames`` and timestamps, the default frame sampler) are
called directly on many sizes.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from longboat.vlm.data.llava_processor import LlavaProcessorConfig, LlavaVisionProcessor
from longboat.vlm.data.processor import VisionProcessorConfig
from longboat.vlm.data.video_processing import (
    frame_group_timestamps,
    qwen3_frame_indices,
    qwen3_video_size,
    uniform_frame_indices,
)
from longboat.vlm.models.qwen3_vl.processor import Qwen3VLVisionProcessor

ARTIFACTS = Path(__file__).parent / "test_data_hf_video_artifacts" / "reference.npz"

# (seed, frames, height, width), the video's fps, the sampling, the processor's settings.
QWEN3_CASES: dict[str, dict[str, Any]] = {
    "fps_shrink": dict(video=(0, 11, 30, 45), video_fps=5.0, sample=dict(fps=2.0),
                       size=(256, 2 * 8 * 8 * 12)),
    "count_odd_grow": dict(video=(1, 9, 17, 23), video_fps=3.0, sample=dict(num_frames=5),
                           size=(5 * 8 * 8 * 10, 10**6)),
    "narrow_frames": dict(video=(2, 6, 6, 40), video_fps=4.0, sample=dict(fps=4.0),
                          size=(256, 4096)),
    "capped": dict(video=(3, 8, 40, 56), video_fps=8.0, sample=dict(fps=4.0), size=(256, 10**6),
                   cap=True, max_video_tokens=6),
}  # fmt: skip
LLAVA_CROP = 16
LLAVA_CASES: dict[str, dict[str, Any]] = {
    "every_frame": dict(video=(4, 5, 20, 37), video_fps=None, sample={}),
    "fps": dict(video=(5, 12, 24, 18), video_fps=6.0, sample=dict(fps=2.0)),
    "count": dict(video=(6, 10, 9, 50), video_fps=3.0, sample=dict(num_frames=3)),
    "crop_sized": dict(video=(7, 3, 16, 16), video_fps=None, sample={}),
}


def case_frames(seed: int, t: int, h: int, w: int) -> np.ndarray:
    """uint8 ``[t, h, w, 3]``: gradients that move from frame to frame, plus noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    frames = []
    for i in range(t):
        base = np.stack(
            [(xx * 255 // max(w - 1, 1) + 17 * i) % 256, yy * 255 // max(h - 1, 1),
             (xx + yy + 9 * i) % 256], -1,
        )  # fmt: skip
        frames.append(np.clip(base + rng.integers(-40, 41, (h, w, 3)), 0, 255))
    return np.stack(frames).astype(np.uint8)


def qwen3_processor(case: dict[str, Any]) -> Qwen3VLVisionProcessor:
    lo, hi = case["size"]
    return Qwen3VLVisionProcessor(
        VisionProcessorConfig(
            patch_size=4, temporal_patch_size=2, merge_size=2,
            image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
            video_min_pixels=lo, video_max_pixels=hi,
            cap_pixels_per_frame=case.get("cap", False),
            max_video_tokens=case.get("max_video_tokens", 768),
        )
    )  # fmt: skip


def llava_processor() -> LlavaVisionProcessor:
    return LlavaVisionProcessor(LlavaProcessorConfig(crop_size=LLAVA_CROP, patch_size=4))


def _ours(processor: Any, case: dict[str, Any]) -> tuple[list[int], dict[str, torch.Tensor]]:
    frames = case_frames(*case["video"])
    sample = case["sample"]
    keep = processor.sample_frames(
        len(frames), video_fps=case["video_fps"] or 1.0, fps=sample.get("fps"),
        num_frames=sample.get("num_frames"),
    )  # fmt: skip
    return keep, processor.preprocess_videos([frames[keep]])


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(ARTIFACTS) as data:
        return dict(data)


@pytest.mark.parametrize("name", sorted(QWEN3_CASES))
def test_qwen3_frames_equal_transformers(name: str, reference: dict[str, np.ndarray]) -> None:
    case = QWEN3_CASES[name]
    keep, got = _ours(qwen3_processor(case), case)
    assert keep == reference[f"qwen3/{name}/indices"].tolist()
    assert got["video_grid_thw"].tolist() == reference[f"qwen3/{name}/grid"].tolist()
    want = torch.from_numpy(reference[f"qwen3/{name}/pixel_values_videos"])
    assert got["pixel_values_videos"].dtype == want.dtype == torch.float32
    assert got["pixel_values_videos"].shape == want.shape
    assert torch.equal(got["pixel_values_videos"], want), (
        f"max |diff| {(got['pixel_values_videos'] - want).abs().max().item():.3g}"
    )


@pytest.mark.parametrize("name", sorted(LLAVA_CASES))
def test_llava_frames_equal_transformers(name: str, reference: dict[str, np.ndarray]) -> None:
    case = LLAVA_CASES[name]
    keep, got = _ours(llava_processor(), case)
    assert keep == reference[f"llava/{name}/indices"].tolist()
    want = torch.from_numpy(reference[f"llava/{name}/pixel_values_videos"])
    assert got["pixel_values_videos"].shape == want.shape == (len(keep), 3, LLAVA_CROP, LLAVA_CROP)
    assert torch.equal(got["pixel_values_videos"], want), (
        f"max |diff| {(got['pixel_values_videos'] - want).abs().max().item():.3g}"
    )
    h, w = case["video"][2:]
    assert got["video_grid_thw"].tolist() == [[len(keep), h, w]]


def test_qwen3_size_sampling_and_timestamps_equal_transformers() -> None:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        smart_resize,
    )
    from transformers.video_utils import VideoMetadata

    rng = np.random.default_rng(0)
    for _ in range(300):
        t = int(rng.integers(2, 40))
        h, w = (int(x) for x in rng.integers(3, 900, 2))
        factor = int(rng.choice([8, 28, 32]))
        lo = int(rng.integers(1, 50)) * factor * factor
        hi = lo * int(rng.integers(1, 400))
        try:
            want = smart_resize(t, h, w, temporal_factor=2, factor=factor, min_pixels=lo,
                                max_pixels=hi)  # fmt: skip
        except ValueError:
            with pytest.raises(ValueError):
                qwen3_video_size(t, h, w, temporal_factor=2, factor=factor, min_pixels=lo,
                                 max_pixels=hi)  # fmt: skip
            continue
        assert qwen3_video_size(t, h, w, temporal_factor=2, factor=factor, min_pixels=lo,
                                max_pixels=hi) == want, (t, h, w, factor, lo, hi)  # fmt: skip
    with pytest.raises(ValueError, match="shorter than temporal_patch_size=2"):
        qwen3_video_size(1, 64, 64, temporal_factor=2, factor=32, min_pixels=1, max_pixels=10**9)

    hf_self = SimpleNamespace(fps=2, min_frames=4, max_frames=40)
    for _ in range(300):
        total = int(rng.integers(1, 200))
        video_fps = float(rng.choice([1.0, 2.5, 23.976, 30.0]))
        by = {"fps": float(rng.choice([0.5, 1.0, 2.0, 4.0]))}
        if rng.random() < 0.3:
            by = {"num_frames": int(rng.integers(1, 60))}
        meta = VideoMetadata(total_num_frames=total, fps=video_fps)
        want = Qwen3VLVideoProcessor.sample_frames(hf_self, meta, **by).tolist()
        got = qwen3_frame_indices(total, video_fps=video_fps, fps=by.get("fps"),
                                  num_frames=by.get("num_frames"), min_frames=4,
                                  max_frames=40)  # fmt: skip
        assert got == want, (total, video_fps, by)
        got_stamps = frame_group_timestamps(got, video_fps, 2)
        assert got_stamps == Qwen3VLProcessor._calculate_timestamps(None, want, video_fps, 2)


def test_default_sampling_equals_transformers() -> None:
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    rng = np.random.default_rng(1)
    refused = 0
    for _ in range(300):
        total = int(rng.integers(1, 200))
        video_fps = float(rng.choice([1.0, 2.5, 23.976, 30.0]))
        by = {"fps": float(rng.choice([0.5, 1.0, 2.0]))}
        if rng.random() < 0.3:
            by = {"num_frames": int(rng.integers(1, total + 1))}
        meta = VideoMetadata(total_num_frames=total, fps=video_fps)
        got = uniform_frame_indices(total, video_fps=video_fps, fps=by.get("fps"),
                                    num_frames=by.get("num_frames"))  # fmt: skip
        try:
            want = default_sample_indices_fn(meta, **by).tolist()
        except ValueError:  # fps above the video's: transformers refuses, we keep every frame
            refused += 1
            want = list(range(total))
        assert got == want, (total, video_fps, by)
    assert refused > 0
    with pytest.raises(ValueError, match="cannot sample 6 frames from a video of 5"):
        uniform_frame_indices(5, video_fps=1.0, fps=None, num_frames=6)
