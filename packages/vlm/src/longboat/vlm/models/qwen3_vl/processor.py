"""Qwen3-VL image processing: Qwen2-VL's (``longboat.vlm.data.processor``) with Qwen3-VL's
settings.

The released Qwen3-VL checkpoints process images with ``Qwen2VLImageProcessor`` (resize to
multiples of ``patch_size * merge_size`` = 32 within the pixel bounds, bicubic, rescale)
and normalise with mean = std = 0.5 instead of CLIP's statistics; the patch layout is the
same. Videos differ (``Qwen3VLVideoProcessor``: its own frame sampling and resizing, and a
timestamp text before every frame group), so this processor refuses them and the data
pipeline names the sample.
"""

from __future__ import annotations

from longboat.vlm.data.processor import QwenVisionProcessor, VisionProcessorConfig
from longboat.vlm.models.qwen3_vl.vision_config import Qwen3VisionConfig

IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)
"""The released Qwen3-VL preprocessor configs' normalisation."""


class Qwen3VLImageProcessor(QwenVisionProcessor):
    """``QwenVisionProcessor`` for Qwen3-VL: images only (``takes_videos`` is read by the
    data pipeline's encoder, which names the sample of a video)."""

    takes_videos = False


def qwen3_vl_processor(
    vision: Qwen3VisionConfig, min_pixels: int, max_pixels: int
) -> Qwen3VLImageProcessor:
    """The processor for ``vision`` (patch, temporal patch and merge sizes) with the given
    pixel bounds and Qwen3-VL's normalisation."""
    return Qwen3VLImageProcessor(
        VisionProcessorConfig(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            image_mean=IMAGE_MEAN,
            image_std=IMAGE_STD,
        )
    )
