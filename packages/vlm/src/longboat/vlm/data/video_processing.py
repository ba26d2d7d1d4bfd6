"""Video frames prepared as transformers' (torchvision-based) video processors prepare them.

transformers' ``Qwen3VLVideoProcessor`` and ``LlavaOnevisionVideoProcessor`` resize the
sampled frames as uint8 tensors with torchvision, which on CPU hands them to
``torch.nn.functional.interpolate(mode="bicubic", antialias=True)`` as uint8 (no float
round trip), then rescale and normalise in one float32 step, ``(x - mean / rescale) /
(std / rescale)``. The functions here make the same torch calls, so their outputs are
bit-identical to transformers' without torchvision. (The image path, like transformers'
PIL image processors, resizes with PIL and rescales in float64: the two differ by a few
uint8 steps after resizing and by float32 rounding after normalising.)

Also here: the frame-sampling rules (Qwen3-VL's and transformers' default one), Qwen3-VL's
video ``smart_resize`` (one pixel budget over all frames) and its per-frame-group
timestamps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "frame_group_timestamps",
    "normalize_frames",
    "qwen3_frame_indices",
    "qwen3_video_size",
    "resize_frames",
    "uniform_frame_indices",
]


def resize_frames(
    frames: np.ndarray | Sequence[np.ndarray], height: int, width: int
) -> torch.Tensor:
    """uint8 ``[T, H, W, 3]`` frames -> uint8 ``[T, 3, height, width]``: antialiased bicubic on
    the uint8 tensor (frames already of that size are returned as they are)."""
    x = torch.from_numpy(np.ascontiguousarray(np.stack(list(frames)))).permute(0, 3, 1, 2)
    x = x.contiguous()
    if tuple(x.shape[-2:]) == (height, width):
        return x
    return torch.nn.functional.interpolate(
        x, size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )


def normalize_frames(
    frames: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    rescale_factor: float,
) -> torch.Tensor:
    """uint8 ``[..., 3, H, W]`` -> float32, rescaled and normalised in one step (mean and std
    divided by ``rescale_factor`` first, in float32)."""
    m = (torch.tensor(tuple(mean)) * (1.0 / rescale_factor)).view(-1, 1, 1)
    s = (torch.tensor(tuple(std)) * (1.0 / rescale_factor)).view(-1, 1, 1)
    return frames.to(torch.float32).sub_(m).div_(s)


def qwen3_frame_indices(
    total_frames: int,
    *,
    video_fps: float,
    fps: float | None,
    num_frames: int | None,
    min_frames: int,
    max_frames: int,
) -> list[int]:
    """Qwen3-VL's frame sampling: ``num_frames`` as given, or ``fps`` frames per second of
    the video (clamped to ``[min_frames, max_frames]`` and the frame count), spread evenly
    from the first frame to the last (rounded); neither: every frame."""
    if fps is not None and num_frames is not None:
        raise ValueError("pass num_frames or fps, not both")
    if num_frames is None and fps is None:
        return list(range(total_frames))
    if num_frames is None:
        count = int(total_frames / video_fps * fps)
        num_frames = min(max(count, min_frames), max_frames, total_frames)
    if num_frames <= 0:
        raise ValueError(f"sampling kept no frames of a video of {total_frames} frames")
    return np.linspace(0, total_frames - 1, num_frames).round().astype(int).tolist()


def uniform_frame_indices(
    total_frames: int, *, video_fps: float, fps: float | None, num_frames: int | None
) -> list[int]:
    """transformers' default frame sampling (LLaVA-OneVision's video processor):
    ``num_frames`` or ``fps`` frames per second (at least one; at most every frame), frame
    ``i * total // n`` for ``i < n``; neither: every frame."""
    if fps is not None and num_frames is not None:
        raise ValueError("pass num_frames or fps, not both")
    if num_frames is None and fps is None:
        return list(range(total_frames))
    if num_frames is None:
        num_frames = min(max(1, int(total_frames / video_fps * fps)), total_frames)
    if num_frames > total_frames:
        raise ValueError(
            f"cannot sample {num_frames} frames from a video of {total_frames}; lower num_frames"
        )
    if num_frames <= 0:
        raise ValueError(f"num_frames={num_frames} must be > 0")
    return (np.arange(num_frames, dtype=int) * total_frames // num_frames).tolist()


def qwen3_video_size(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Qwen3-VL's resized frame size: sides multiples of ``factor``; the pixels of all frames
    (frame count rounded to ``temporal_factor``) within ``[min_pixels, max_pixels]``; frames
    smaller than ``factor`` scaled up first; a video shorter than ``temporal_factor`` frames
    or with an aspect ratio above 200 refused."""
    if num_frames < temporal_factor:
        raise ValueError(
            f"a video of {num_frames} frame(s) is shorter than temporal_patch_size="
            f"{temporal_factor}; sample more frames (fps / num_frames) or drop it"
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"frames of {height}x{width}: aspect ratio "
            f"{max(height, width) / min(height, width):.1f} is above 200"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(num_frames / temporal_factor) * temporal_factor
    if t * h * w > max_pixels:
        shrink = math.sqrt(num_frames * height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif t * h * w < min_pixels:
        grow = math.sqrt(min_pixels / (num_frames * height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def frame_group_timestamps(
    indices: Sequence[int], video_fps: float, temporal_patch_size: int
) -> list[float]:
    """Seconds of each temporal frame group: the mean time of its first and last frame (the
    indices padded to a multiple of ``temporal_patch_size`` by repeating the last)."""
    idx = list(indices)
    idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
    seconds = [i / video_fps for i in idx]
    tp = temporal_patch_size
    return [(seconds[g] + seconds[g + tp - 1]) / 2 for g in range(0, len(seconds), tp)]
