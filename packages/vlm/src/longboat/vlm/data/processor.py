"""Qwen2-VL / Qwen2.5-VL image and video processor (PIL + numpy).

Images follow transformers' ``Qwen2VLImageProcessorPil`` step for step, so the outputs are
bit-identical to it: RGB (alpha composited onto white), ``smart_resize`` to multiples of
``patch_size * merge_size`` within ``[min_pixels, max_pixels]``, PIL bicubic resize of the
uint8 image, rescale by ``1/255`` (in float64, then float32), CLIP mean/std normalisation,
the image repeated ``temporal_patch_size`` times, and patches flattened to
``pixel_values [N, C*T*p*p]`` in merge-block-major order with ``image_grid_thw [n, 3]``.

Videos follow ``Qwen2VLVideoProcessor``'s rules (its own min/max pixels, optional per-frame
pixel cap, frame sampling by count or fps, the last frame repeated up to a multiple of
``temporal_patch_size``) and its patch layout. transformers resizes video frames with
torchvision's bicubic on tensors; here every frame goes through the same PIL bicubic as
images, so the grids are equal and pixel values may differ from transformers' video
processor by a few uint8 steps at edges.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

ImageLike = Image.Image | np.ndarray
"""A PIL image or a uint8 array ``[H, W]`` / ``[H, W, C]`` (C = 1, 3 or 4)."""


@dataclass(frozen=True, kw_only=True)
class VisionProcessorConfig:
    """Settings of the processor (defaults: Qwen2.5-VL's released preprocessor configs)."""

    patch_size: int = 14
    """Spatial patch side in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch."""
    merge_size: int = 2
    """Patches merged per side by the vision tower's merger."""
    min_pixels: int = 56 * 56
    """Fewest pixels of a resized image."""
    max_pixels: int = 28 * 28 * 1280
    """Most pixels of a resized image."""
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    """Per-channel mean subtracted after rescaling."""
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    """Per-channel std divided by after the mean."""
    rescale_factor: float = 1 / 255
    """uint8 -> [0, 1] factor."""
    video_min_pixels: int = 128 * 28 * 28
    """Fewest pixels of a resized video frame."""
    video_max_pixels: int = 28 * 28 * 768
    """Most pixels of a resized video frame."""
    min_frames: int = 4
    """Fewest frames fps-based sampling keeps."""
    max_frames: int = 768
    """Most frames fps-based sampling keeps."""
    cap_pixels_per_frame: bool = False
    """Also cap each frame at an even share of ``max_video_tokens`` tokens' pixels."""
    max_video_tokens: int = 128000
    """Token budget of one video when ``cap_pixels_per_frame`` is on."""

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (``patch_size * merge_size``)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf(
        cls,
        image_config: Mapping[str, Any],
        video_config: Mapping[str, Any] | None = None,
    ) -> VisionProcessorConfig:
        """Read an HF ``preprocessor_config.json`` (and ``video_preprocessor_config.json``)."""

        def pixels(d: Mapping[str, Any], lo: int, hi: int) -> tuple[int, int]:
            size = d.get("size") or {}
            return (
                int(d.get("min_pixels", size.get("shortest_edge", lo))),
                int(d.get("max_pixels", size.get("longest_edge", hi))),
            )

        base = cls()
        lo, hi = pixels(image_config, base.min_pixels, base.max_pixels)
        kwargs: dict[str, Any] = dict(
            patch_size=int(image_config.get("patch_size", base.patch_size)),
            temporal_patch_size=int(
                image_config.get("temporal_patch_size", base.temporal_patch_size)
            ),
            merge_size=int(image_config.get("merge_size", base.merge_size)),
            min_pixels=lo,
            max_pixels=hi,
            image_mean=tuple(image_config.get("image_mean", base.image_mean)),
            image_std=tuple(image_config.get("image_std", base.image_std)),
            rescale_factor=float(image_config.get("rescale_factor", base.rescale_factor)),
        )
        if video_config is not None:
            vlo, vhi = pixels(video_config, base.video_min_pixels, base.video_max_pixels)
            kwargs |= dict(
                video_min_pixels=vlo,
                video_max_pixels=vhi,
                min_frames=int(video_config.get("min_frames", base.min_frames)),
                max_frames=int(video_config.get("max_frames", base.max_frames)),
                cap_pixels_per_frame=bool(video_config.get("cap_pixels_per_frame") or False),
                max_video_tokens=int(video_config.get("max_video_tokens", base.max_video_tokens)),
            )
        return cls(**kwargs)


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Sides rounded to multiples of ``factor``, area within ``[min_pixels, max_pixels]``,
    aspect ratio kept as closely as possible (aspect ratios above 200 are refused)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"image of {height}x{width}: aspect ratio {max(height, width) / min(height, width):.1f}"
            " is above 200"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def to_rgb_array(image: ImageLike) -> np.ndarray:
    """``[H, W, 3]`` uint8; transparent pixels composited onto white."""
    if isinstance(image, Image.Image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return np.array(Image.alpha_composite(white, rgba).convert("RGB"))
        return np.array(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.dtype != np.uint8:
        raise TypeError(f"image arrays must be uint8 [H, W(, C)], got {arr.dtype}")
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4):
        raise ValueError(f"image arrays must be [H, W] or [H, W, 1|3|4], got {arr.shape}")
    if arr.shape[-1] == 1:
        return np.repeat(arr, 3, axis=-1)
    if arr.shape[-1] == 4:
        alpha = arr[..., 3:4] / 255
        return np.round(alpha * arr[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return arr


def _resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    return np.array(Image.fromarray(rgb).resize((width, height), resample=Image.Resampling.BICUBIC))


def _normalize(rgb: np.ndarray, cfg: VisionProcessorConfig) -> np.ndarray:
    """uint8 ``[..., H, W, 3]`` -> float32 ``[..., 3, H, W]``, rescaled and normalised."""
    x = (rgb.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    return np.moveaxis(x, -1, -3)


def patchify(
    frames: np.ndarray, cfg: VisionProcessorConfig
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``[T, C, H, W]`` (T a multiple of ``temporal_patch_size``) -> ``[t*h*w, C*Tp*p*p]``.

    Rows run frame group by frame group, then merge block by merge block (row-major), then
    within each block; each row is channel-major, then time, then the patch's pixels.
    """
    t_all, c, height, width = frames.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if t_all % tp or height % (p * m) or width % (p * m):
        raise ValueError(
            f"patchify: frames {frames.shape} must have T % {tp} == 0 and H, W multiples of {p * m}"
        )
    gt, gh, gw = t_all // tp, height // p, width // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # gt, bh, bw, mh, mw, C, Tp, ph, pw
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)


def sample_frame_indices(
    total_frames: int,
    cfg: VisionProcessorConfig,
    *,
    num_frames: int | None = None,
    fps: float | None = None,
    video_fps: float | None = None,
) -> list[int]:
    """Indices of the frames to keep, as transformers' Qwen2-VL video processor picks them.

    ``num_frames`` (rounded to a multiple of ``temporal_patch_size``) or ``fps`` (with the
    video's own ``video_fps``; clamped to ``[min_frames, max_frames]`` and the frame count)
    sample uniformly from frame 0; with neither, every frame is kept.
    """
    tp = cfg.temporal_patch_size
    if num_frames is not None and fps is not None:
        raise ValueError("sample_frame_indices: pass num_frames or fps, not both")
    if num_frames is not None:
        count: float = round(num_frames / tp) * tp
    elif fps is not None:
        if video_fps is None:
            raise ValueError("sample_frame_indices: fps sampling needs the video's video_fps")
        most = math.floor(min(cfg.max_frames, total_frames) / tp) * tp
        count = total_frames / video_fps * fps
        count = min(max(count, cfg.min_frames), most, total_frames)
        count = math.floor(count / tp) * tp
    else:
        return list(range(total_frames))
    if count > total_frames:
        raise ValueError(
            f"cannot sample {count} frames from a video of {total_frames}; lower num_frames or fps"
        )
    if count <= 0:
        raise ValueError(f"sampling kept no frames of a video of {total_frames} frames")
    return torch.arange(0, total_frames, total_frames / count).int().tolist()


class QwenVisionProcessor:
    """Images / videos -> the tower's flattened patches and grids (see the module doc).

    What the data pipeline's encoder asks of every family's processor (geometry before any
    pixels are decoded): ``sample_frames``, ``video_grid``, ``video_tokens``,
    ``video_placeholder``; ``position_kind`` names the packed rows' position ids.
    """

    position_kind = "mrope"
    """Packed rows' position ids: M-RoPE, a video's frame groups on one temporal axis."""
    takes_videos = True

    def __init__(self, config: VisionProcessorConfig | None = None) -> None:
        self.config = config or VisionProcessorConfig()

    def sample_frames(
        self, total_frames: int, *, video_fps: float, fps: float | None, num_frames: int | None
    ) -> list[int]:
        """Indices of the frames kept of a ``total_frames``-frame video
        (``sample_frame_indices``)."""
        return sample_frame_indices(
            total_frames, self.config, num_frames=num_frames, fps=fps, video_fps=video_fps
        )

    def video_grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patch grid of ``num_frames`` sampled frames of ``height x width``."""
        h, w = self.video_size(num_frames, height, width)
        c = self.config
        return -(-num_frames // c.temporal_patch_size), h // c.patch_size, w // c.patch_size

    def video_tokens(self, grid: Sequence[int]) -> int:
        """Placeholder (pad) tokens of a video with grid ``grid``: one per merged patch."""
        return math.prod(int(g) for g in grid) // self.config.merge_size**2

    def video_placeholder(
        self,
        grid: Sequence[int],
        frames: Sequence[int],
        video_fps: float,
        tokens: Any,
        text_ids: Callable[[str], list[int]],
    ) -> list[int]:
        """Token ids that stand for a video in place of its one pad token: here the pad
        repeated ``video_tokens(grid)`` times (``tokens``: the ``VisionTokens``; ``text_ids``
        tokenizes text, for families that write text into the placeholder)."""
        return [tokens.video_pad_id] * self.video_tokens(grid)

    def image_size(self, height: int, width: int) -> tuple[int, int]:
        """Resized (height, width) of an image of ``height`` x ``width``."""
        c = self.config
        return smart_resize(
            height, width, factor=c.factor, min_pixels=c.min_pixels, max_pixels=c.max_pixels
        )

    def video_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """Resized (height, width) of the frames of a ``num_frames``-frame video."""
        c = self.config
        most = c.video_max_pixels
        if c.cap_pixels_per_frame:
            budget = int(c.max_video_tokens * c.factor * c.factor * 0.9)
            most = max(
                min(most, budget * c.temporal_patch_size // num_frames),
                int(c.video_min_pixels * 1.05),
            )
        return smart_resize(
            height, width, factor=c.factor, min_pixels=c.video_min_pixels, max_pixels=most
        )

    def preprocess_images(self, images: Sequence[ImageLike]) -> dict[str, torch.Tensor]:
        """``{"pixel_values": float32 [N, C*T*p*p], "image_grid_thw": int64 [n, 3]}``."""
        patches, grids = [], []
        tp = self.config.temporal_patch_size
        for image in images:
            rgb = to_rgb_array(image)
            rgb = _resize(rgb, *self.image_size(*rgb.shape[:2]))
            frame = _normalize(rgb, self.config)[None]
            rows, grid = patchify(np.repeat(frame, tp, axis=0), self.config)
            patches.append(rows)
            grids.append(grid)
        return {
            "pixel_values": torch.from_numpy(np.concatenate(patches)),
            "image_grid_thw": torch.tensor(grids, dtype=torch.int64),
        }

    def preprocess_videos(
        self,
        videos: Sequence[Sequence[ImageLike] | np.ndarray],
        *,
        num_frames: int | None = None,
        fps: float | None = None,
        video_fps: float | Sequence[float] | None = None,
    ) -> dict[str, torch.Tensor]:
        """``{"pixel_values_videos": [N, C*T*p*p], "video_grid_thw": [n, 3]}``.

        Each video is a list of frames or a uint8 ``[T, H, W, C]`` array; ``num_frames`` /
        ``fps`` (+ each video's ``video_fps``) sample frames as ``sample_frame_indices``.
        """
        patches, grids = [], []
        tp = self.config.temporal_patch_size
        for i, video in enumerate(videos):
            frames = list(video)
            if not frames:
                raise ValueError(f"video {i} has no frames")
            rate = video_fps[i] if isinstance(video_fps, Sequence) else video_fps
            keep = sample_frame_indices(
                len(frames), self.config, num_frames=num_frames, fps=fps, video_fps=rate
            )
            rgb = [to_rgb_array(frames[j]) for j in keep]
            shapes = {f.shape for f in rgb}
            if len(shapes) != 1:
                raise ValueError(f"video {i}: frames differ in size {sorted(shapes)}")
            h, w = self.video_size(len(rgb), *rgb[0].shape[:2])
            clip = _normalize(np.stack([_resize(f, h, w) for f in rgb]), self.config)
            if pad := -len(clip) % tp:
                clip = np.concatenate([clip, np.repeat(clip[-1:], pad, axis=0)])
            rows, grid = patchify(clip, self.config)
            patches.append(rows)
            grids.append(grid)
        return {
            "pixel_values_videos": torch.from_numpy(np.concatenate(patches)),
            "video_grid_thw": torch.tensor(grids, dtype=torch.int64),
        }
