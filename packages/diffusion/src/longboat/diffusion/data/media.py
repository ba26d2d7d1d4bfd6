"""Videos and images -> the frames a VAE encodes: frame sampling, resize and centre crop.

- **Size**: the target ``(height, width)`` is the one of ``targets`` nearest the input's aspect
  ratio (in log ratio; ties: the first). The input is scaled so it covers the target with its
  aspect ratio kept (bicubic, PIL), then centre-cropped to it.
- **Frames** (videos): frame ``k`` is source frame ``round(k * source_fps / fps)`` from the
  start (every frame in order with ``fps=None``), for ``k < num_frames``. A video too short
  for ``num_frames`` keeps the largest ``temporal * j + 1`` frames it has (the Wan VAE encodes
  the first frame alone, then ``temporal`` = 4 frames per latent frame). The frame rate of
  the kept frames is ``fps`` (the source's with ``fps=None``).
- **Images** are one frame (frame rate 0).

Failures (unreadable, corrupt, empty) raise
:class:`~longboat.diffusion.data.errors.BadSampleError` naming the file. PyAV is imported only
when a video is read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from longboat.diffusion.data.errors import BadSampleError

__all__ = [
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "Clip",
    "choose_size",
    "frame_indices",
    "load_clip",
    "resize_crop",
]

VIDEO_SUFFIXES = frozenset({".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v"})
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})


@dataclass(frozen=True)
class Clip:
    """Frames ready to encode: uint8 ``[T, H, W, 3]`` and their frame rate (0 for images)."""

    frames: np.ndarray
    fps: float


def choose_size(height: int, width: int, targets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The target ``(h, w)`` whose aspect ratio is nearest ``width / height``."""
    ratio = math.log(width / height)
    return min(targets, key=lambda t: abs(math.log(t[1] / t[0]) - ratio))


def resize_crop(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """Scale ``frame`` (uint8 ``[h, w, 3]``) to cover ``height x width``, then centre-crop."""
    from PIL import Image

    h0, w0 = frame.shape[:2]
    scale = max(height / h0, width / w0)
    nw, nh = max(width, round(w0 * scale)), max(height, round(h0 * scale))
    img = Image.fromarray(frame)
    if (nw, nh) != (w0, h0):
        img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - width) // 2, (nh - height) // 2
    return np.asarray(img.crop((left, top, left + width, top + height)))


def frame_indices(
    available: int, source_fps: float, num_frames: int, fps: float | None, temporal: int = 4
) -> list[int]:
    """Source frame indices to keep (see the module doc); empty when none fit."""
    step = 1.0 if fps is None else source_fps / fps
    idx = [math.floor(k * step + 0.5) for k in range(num_frames)]
    keep = sum(1 for i in idx if i < available)
    keep = (keep - 1) // temporal * temporal + 1 if keep >= 1 else 0
    return idx[:keep]


def _read_video(
    path: Path, num_frames: int, fps: float | None, temporal: int
) -> tuple[list[np.ndarray], float]:
    """Decoded frames up to the last one needed, and the source frame rate."""
    import av

    frames: list[np.ndarray] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise BadSampleError(str(path), "has no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            if not rate or float(rate) <= 0:
                raise BadSampleError(str(path), "has no frame rate")
            last = frame_indices(1 << 30, float(rate), num_frames, fps, temporal)[-1]
            for frame in container.decode(stream):
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) > last:
                    break
    except BadSampleError:
        raise
    except Exception as exc:  # PyAV raises FFmpeg errors of many kinds for broken files
        raise BadSampleError(str(path), f"not a readable video ({exc})") from None
    return frames, float(rate)


def _read_image(path: Path) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.load()
            return np.asarray(img.convert("RGB"))
    except FileNotFoundError:
        raise BadSampleError(str(path), "file not found") from None
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise BadSampleError(str(path), f"not a readable image ({exc})") from None


def load_clip(
    path: str | Path,
    *,
    targets: Sequence[tuple[int, int]],
    num_frames: int,
    fps: float | None,
    temporal: int = 4,
) -> Clip:
    """The frames of a video or image file, sampled, resized and cropped (module doc)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if not p.is_file():
        raise BadSampleError(str(p), "file not found" if not p.exists() else "not a file")
    if suffix in IMAGE_SUFFIXES:
        image = _read_image(p)
        h, w = choose_size(image.shape[0], image.shape[1], targets)
        return Clip(frames=resize_crop(image, h, w)[None], fps=0.0)
    if suffix not in VIDEO_SUFFIXES:
        raise BadSampleError(
            str(p),
            f"unsupported file type {suffix!r} (videos: {', '.join(sorted(VIDEO_SUFFIXES))}; "
            f"images: {', '.join(sorted(IMAGE_SUFFIXES))})",
        )
    frames, rate = _read_video(p, num_frames, fps, temporal)
    keep = frame_indices(len(frames), rate, num_frames, fps, temporal)
    if not keep:
        raise BadSampleError(str(p), "has no decodable frames")
    h, w = choose_size(frames[0].shape[0], frames[0].shape[1], targets)
    out = np.stack([resize_crop(frames[i], h, w) for i in keep])
    return Clip(frames=out, fps=rate if fps is None else float(fps))
