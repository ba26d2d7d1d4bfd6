"""LLaVA-OneVision image processor (PIL + numpy), equal to transformers'
``LlavaOnevisionImageProcessorPil`` on the same images.

An image alone in its sample is tiled ("anyres", ``longboat.vlm.models.llava_onevision.
anyres``): resized (PIL bicubic, aspect ratio kept) into the best pinpoint resolution,
centred on black padding and cut into ``crop x crop`` tiles, after a base view of the whole
image squashed to ``crop x crop``. An image that shares its sample with others is padded to
a square with the mean colour and resized to one view. Every view is rescaled by ``1/255``
(in float64, then float32) and normalised with the CLIP mean and std.

Outputs: ``pixel_values [views, 3, crop, crop]`` (the images' views back to back, base view
first) and ``image_grid_thw [images, 3]``, each row ``(views, height, width)`` with the
image's size before processing, which is what the model needs to undo the tiling.

Videos, as transformers' ``LlavaOnevisionVideoProcessor`` (``do_sample_frames`` with the
given ``fps`` / ``num_frames``; neither: every frame): frames ``i * total // n``, each
squashed to ``crop x crop`` and normalised the way its torchvision path does
(``longboat.vlm.data.video_processing``, bit-identical); ``pixel_values_videos [frames, 3,
crop, crop]`` and ``video_grid_thw`` rows ``(frames, height, width)``. A video stands for
``frames * ceil(grid / 2) ** 2 + 1`` tokens (pooled frame features, one newline).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from longboat.vlm.data.processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageLike, to_rgb_array
from longboat.vlm.data.video_processing import (
    normalize_frames,
    resize_frames,
    uniform_frame_indices,
)
from longboat.vlm.models.llava_onevision.anyres import (
    best_resolution,
    fitted_size,
    num_image_tokens,
    num_video_tokens,
    tile_grid,
)


@dataclass(frozen=True, kw_only=True)
class LlavaProcessorConfig:
    """Settings of the processor (defaults: the released LLaVA-OneVision models')."""

    crop_size: int = 384
    """Side of every view in pixels (the tower's ``image_size``)."""
    patch_size: int = 14
    """The tower's patch side (for the token counts)."""
    image_grid_pinpoints: tuple[tuple[int, int], ...] = tuple(
        (384 * r, 384 * c) for r in range(1, 7) for c in range(1, 7)
    )
    vision_aspect_ratio: str = "anyres_max_9"
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    @property
    def grid(self) -> int:
        """Tower patches per side of one view."""
        return self.crop_size // self.patch_size

    def to_hf(self) -> dict[str, Any]:
        """``preprocessor_config.json`` of transformers' LLaVA-OneVision image processor."""
        return {
            "image_processor_type": "LlavaOnevisionImageProcessor",
            "size": {"height": self.crop_size, "width": self.crop_size},
            "image_grid_pinpoints": [list(p) for p in self.image_grid_pinpoints],
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "rescale_factor": self.rescale_factor,
            "resample": 3,
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "do_pad": True,
        }


def _resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    if rgb.shape[:2] == (height, width):
        return rgb
    return np.array(Image.fromarray(rgb).resize((width, height), resample=Image.Resampling.BICUBIC))


class LlavaVisionProcessor:
    """Images and videos -> views, frames and geometry for the LLaVA-OneVision family (see
    the module doc)."""

    position_kind = "1d"

    def __init__(self, config: LlavaProcessorConfig | None = None) -> None:
        self.config = config or LlavaProcessorConfig()

    # -- geometry (what the encoder needs before decoding pixels) ---------------------------

    def image_grid(self, height: int, width: int, *, alone: bool = True) -> tuple[int, int, int]:
        """``(views, height, width)`` of an image (``alone``: the only one of its sample)."""
        if not alone:
            return 1, height, width
        rows, cols = tile_grid(
            height, width, self.config.image_grid_pinpoints, self.config.crop_size
        )
        return rows * cols + 1, height, width

    def grid_tokens(self, grid: Sequence[int]) -> int:
        """Placeholder tokens of an image with ``image_grid`` row ``grid``."""
        c = self.config
        views, height, width = (int(x) for x in grid)
        return num_image_tokens(
            height, width, tiled=views > 1, grid=c.grid, crop=c.crop_size,
            pinpoints=c.image_grid_pinpoints, vision_aspect_ratio=c.vision_aspect_ratio,
        )  # fmt: skip

    # -- pixels -----------------------------------------------------------------------------

    def _normalize(self, views: np.ndarray) -> np.ndarray:
        c = self.config
        x = (views.astype(np.float64) * c.rescale_factor).astype(np.float32)
        x = (x - np.asarray(c.image_mean, np.float32)) / np.asarray(c.image_std, np.float32)
        return np.moveaxis(x, -1, -3)

    def _tiles(self, rgb: np.ndarray) -> list[np.ndarray]:
        c, s = self.config, self.config.crop_size
        h, w = rgb.shape[:2]
        target = best_resolution(h, w, c.image_grid_pinpoints)
        nh, nw = fitted_size(h, w, target)
        fitted = _resize(rgb, nh, nw)
        canvas = np.zeros((*target, 3), dtype=np.uint8)
        top, left = (target[0] - nh) // 2, (target[1] - nw) // 2
        canvas[top : top + nh, left : left + nw] = fitted
        tiles = [canvas[i : i + s, j : j + s] for i in range(0, target[0], s)
                 for j in range(0, target[1], s)]  # fmt: skip
        return [_resize(rgb, s, s), *tiles]

    def _square(self, rgb: np.ndarray) -> np.ndarray:
        h, w = rgb.shape[:2]
        side = max(h, w)
        fill = np.asarray([int(m * 255) for m in self.config.image_mean], dtype=np.uint8)
        canvas = np.empty((side, side, 3), dtype=np.uint8)
        canvas[...] = fill
        top, left = (side - h) // 2, (side - w) // 2
        canvas[top : top + h, left : left + w] = rgb
        return _resize(canvas, self.config.crop_size, self.config.crop_size)

    def preprocess_images(self, images: Sequence[ImageLike]) -> dict[str, torch.Tensor]:
        """``pixel_values [views, 3, S, S]`` float32 and ``image_grid_thw [n, 3]`` of the
        images of one sample (tiled when there is one)."""
        rgbs = [to_rgb_array(im) for im in images]
        alone = len(rgbs) == 1
        views: list[np.ndarray] = []
        grids = []
        for rgb in rgbs:
            parts = self._tiles(rgb) if alone else [self._square(rgb)]
            views += parts
            grids.append((len(parts), rgb.shape[0], rgb.shape[1]))
        pixels = self._normalize(np.stack(views))
        return {
            "pixel_values": torch.from_numpy(np.ascontiguousarray(pixels)),
            "image_grid_thw": torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
        }

    # -- videos -----------------------------------------------------------------------------

    def sample_frames(
        self, total_frames: int, *, video_fps: float, fps: float | None, num_frames: int | None
    ) -> list[int]:
        """Indices of the frames kept (``uniform_frame_indices``)."""
        return uniform_frame_indices(
            total_frames, video_fps=video_fps, fps=fps, num_frames=num_frames
        )

    def video_grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """``(frames, height, width)``: the sampled frame count and the frames' size."""
        return num_frames, height, width

    def video_tokens(self, grid: Sequence[int]) -> int:
        """Placeholder tokens of a video with ``video_grid`` row ``grid``."""
        return num_video_tokens(int(grid[0]), self.config.grid)

    def video_placeholder(
        self,
        grid: Sequence[int],
        frames: Sequence[int],
        video_fps: float,
        tokens: Any,
        text_ids: Any,
    ) -> list[int]:
        """The video pad repeated ``video_tokens(grid)`` times."""
        return [tokens.video_pad_id] * self.video_tokens(grid)

    def preprocess_videos(
        self, videos: Sequence[Sequence[ImageLike] | np.ndarray]
    ) -> dict[str, torch.Tensor]:
        """``pixel_values_videos [frames, 3, S, S]`` float32 (the videos' frames back to back)
        and ``video_grid_thw [videos, 3]`` of already sampled videos."""
        c = self.config
        clips, grids = [], []
        for i, video in enumerate(videos):
            rgb = [to_rgb_array(f) for f in video]
            if not rgb:
                raise ValueError(f"video {i} has no frames")
            shapes = {f.shape for f in rgb}
            if len(shapes) != 1:
                raise ValueError(f"video {i}: frames differ in size {sorted(shapes)}")
            frames = resize_frames(rgb, c.crop_size, c.crop_size)
            clips.append(normalize_frames(frames, c.image_mean, c.image_std, c.rescale_factor))
            grids.append(self.video_grid(len(rgb), *rgb[0].shape[:2]))
        return {
            "pixel_values_videos": torch.cat(clips),
            "video_grid_thw": torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
        }
