"""Qwen3-VL image and video processing, equal to transformers' ``Qwen3VLProcessor`` with
``Qwen2VLImageProcessor`` images and ``Qwen3VLVideoProcessor`` videos.

Images: Qwen2-VL's processing (``longboat.vlm.data.processor``: resize to multiples of
``patch_size * merge_size`` = 32 within the pixel bounds, bicubic, rescale) with mean = std
= 0.5 instead of CLIP's statistics; the patch layout is the same.

Videos: frames sampled at ``fps`` (clamped to ``[min_frames, max_frames]``) or by count,
evenly from the first frame to the last; resized with one pixel budget over all frames
(``video_min_pixels`` / ``video_max_pixels``: the released 4096 / 25165824), optionally
capped per frame; resized, rescaled and normalised as transformers' torchvision path does
(``longboat.vlm.data.video_processing``, bit-identical); the last frame repeated up to a
multiple of ``temporal_patch_size``; Qwen2-VL's patch layout. In the text each temporal
frame group is written ``<{t:.1f} seconds>`` + ``<|vision_start|>`` + its pads +
``<|vision_end|>``, ``t`` the mean time of the group's first and last frame; this replaces
the video's one pad token, inside the chat template's own start / end tokens (as
transformers does). Packed rows place each frame group like a one-frame image
(``position_kind = "mrope_frames"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from longboat.vlm.data.processor import (
    ImageLike,
    QwenVisionProcessor,
    VisionProcessorConfig,
    patchify,
    to_rgb_array,
)
from longboat.vlm.data.video_processing import (
    frame_group_timestamps,
    normalize_frames,
    qwen3_frame_indices,
    qwen3_video_size,
    resize_frames,
)
from longboat.vlm.models.qwen3_vl.vision_config import Qwen3VisionConfig

IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)
"""The released Qwen3-VL preprocessor configs' normalisation."""
VIDEO_MIN_PIXELS = 4096
VIDEO_MAX_PIXELS = 25165824
"""The released ``video_preprocessor_config.json``'s ``size`` (pixels of all frames)."""
MAX_VIDEO_TOKENS = 768
"""``Qwen3VLVideoProcessor.max_video_tokens``: the per-frame token ceiling of the cap."""


class Qwen3VLVisionProcessor(QwenVisionProcessor):
    """Qwen3-VL's processor (see the module doc). ``config.max_video_tokens`` is a per-frame
    ceiling here (Qwen2-VL's is the video's budget); ``cap_pixels_per_frame`` applies it."""

    position_kind = "mrope_frames"
    """Packed rows' position ids: M-RoPE with each frame group placed like an image."""

    def sample_frames(
        self, total_frames: int, *, video_fps: float, fps: float | None, num_frames: int | None
    ) -> list[int]:
        c = self.config
        return qwen3_frame_indices(
            total_frames, video_fps=video_fps, fps=fps, num_frames=num_frames,
            min_frames=c.min_frames, max_frames=c.max_frames,
        )  # fmt: skip

    def video_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        c = self.config
        most = c.video_max_pixels
        if c.cap_pixels_per_frame:
            per_frame = max(
                min(c.max_video_tokens * c.factor * c.factor, most // num_frames),
                int(c.video_min_pixels * 1.05),
            )
            most = per_frame * num_frames
        return qwen3_video_size(
            num_frames, height, width, temporal_factor=c.temporal_patch_size, factor=c.factor,
            min_pixels=c.video_min_pixels, max_pixels=most,
        )  # fmt: skip

    def video_timestamps(self, frames: Sequence[int], video_fps: float) -> list[float]:
        """Seconds of each temporal frame group of the sampled ``frames``."""
        return frame_group_timestamps(frames, video_fps, self.config.temporal_patch_size)

    def video_placeholder(
        self,
        grid: Sequence[int],
        frames: Sequence[int],
        video_fps: float,
        tokens: Any,
        text_ids: Callable[[str], list[int]],
    ) -> list[int]:
        """Per frame group: ``<{t:.1f} seconds>`` (tokenized) + vision start + pads + end."""
        per_group = self.video_tokens(grid) // int(grid[0])
        pads = [tokens.video_pad_id] * per_group
        out: list[int] = []
        for seconds in self.video_timestamps(frames, video_fps):
            out += text_ids(f"<{seconds:.1f} seconds>")
            out += [tokens.vision_start_id, *pads, tokens.vision_end_id]
        return out

    def preprocess_videos(
        self,
        videos: Sequence[Sequence[ImageLike] | np.ndarray],
        *,
        num_frames: int | None = None,
        fps: float | None = None,
        video_fps: float | Sequence[float] | None = None,
    ) -> dict[str, torch.Tensor]:
        """``{"pixel_values_videos": [N, C*T*p*p], "video_grid_thw": [n, 3]}``; each video a
        list of frames or a uint8 ``[T, H, W, C]`` array, sampled first when ``num_frames``
        or ``fps`` (with each video's ``video_fps``) is given."""
        c = self.config
        patches, grids = [], []
        for i, video in enumerate(videos):
            frames = list(video)
            if not frames:
                raise ValueError(f"video {i} has no frames")
            if num_frames is not None or fps is not None:
                rate = video_fps[i] if isinstance(video_fps, Sequence) else video_fps
                if rate is None:
                    raise ValueError("sampling by fps or num_frames needs each video's video_fps")
                keep = self.sample_frames(
                    len(frames), video_fps=rate, fps=fps, num_frames=num_frames
                )
                frames = [frames[j] for j in keep]
            rgb = [to_rgb_array(f) for f in frames]
            shapes = {f.shape for f in rgb}
            if len(shapes) != 1:
                raise ValueError(f"video {i}: frames differ in size {sorted(shapes)}")
            h, w = self.video_size(len(rgb), *rgb[0].shape[:2])
            clip = normalize_frames(resize_frames(rgb, h, w), c.image_mean, c.image_std,
                                    c.rescale_factor).numpy()  # fmt: skip
            if pad := -len(clip) % c.temporal_patch_size:
                clip = np.concatenate([clip, np.repeat(clip[-1:], pad, axis=0)])
            rows, grid = patchify(clip, c)
            patches.append(rows)
            grids.append(grid)
        return {
            "pixel_values_videos": torch.from_numpy(np.concatenate(patches)),
            "video_grid_thw": torch.tensor(grids, dtype=torch.int64),
        }


def qwen3_vl_processor(
    vision: Qwen3VisionConfig,
    min_pixels: int,
    max_pixels: int,
    **video: Any,
) -> Qwen3VLVisionProcessor:
    """The processor for ``vision`` (patch, temporal patch and merge sizes) with the given
    image pixel bounds, Qwen3-VL's normalisation and its released video settings
    (``video``: ``VisionProcessorConfig`` video fields to override)."""
    config = VisionProcessorConfig(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        image_mean=IMAGE_MEAN,
        image_std=IMAGE_STD,
        video_min_pixels=VIDEO_MIN_PIXELS,
        video_max_pixels=VIDEO_MAX_PIXELS,
        max_video_tokens=MAX_VIDEO_TOKENS,
    )
    return Qwen3VLVisionProcessor(dataclasses.replace(config, **video))
