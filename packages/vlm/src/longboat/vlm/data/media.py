"""Reading the images and videos a :class:`~longboat.vlm.data.conversations.MediaRef` names.

Images: any format PIL reads (JPEG, PNG, ...), from a file or embedded bytes, decoded in
full so a truncated file fails here rather than in a training step. Videos: a video file or
bytes decoded with PyAV (``av``, imported only when a video is read), a folder of frame
images (sorted by name), or a list of frame files. Every failure raises
:class:`~longboat.vlm.data.errors.BadMediaError` naming the sample's row, the field and the
file.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from longboat.vlm.data.conversations import IMAGE_SUFFIXES, MediaRef
from longboat.vlm.data.errors import BadMediaError

__all__ = ["Video", "VideoOptions", "load_image", "load_video"]


@dataclass(frozen=True, kw_only=True)
class VideoOptions:
    """How videos are sampled into frames."""

    fps: float | None = 2.0
    """Frames kept per second of video (HF Qwen2.5-VL's default); ``None`` with
    ``num_frames=None`` keeps every frame."""
    num_frames: int | None = None
    """Frames kept per video (uniformly spaced) instead of ``fps``."""
    frames_fps: float = 2.0
    """The frame rate assumed for videos given as frame images (folder or list)."""

    def __post_init__(self) -> None:
        if self.num_frames is not None and self.fps is not None:
            raise ValueError(
                "VideoOptions: set fps or num_frames, not both (fps=None to sample by count)"
            )
        if self.frames_fps <= 0:
            raise ValueError(f"VideoOptions.frames_fps={self.frames_fps} must be > 0")


@dataclass(frozen=True)
class Video:
    """Decoded frames (uint8 ``[H, W, 3]`` each) and the video's native frame rate."""

    frames: list[np.ndarray]
    fps: float


def _open_image(source: str | io.BytesIO, at: str, ref: MediaRef) -> Image.Image:
    try:
        with Image.open(source) as img:
            img.load()
            return img.convert("RGBA" if "A" in img.getbands() else "RGB")
    except FileNotFoundError:
        raise BadMediaError(at, ref.field, ref.describe(), "file not found") from None
    except UnidentifiedImageError:
        raise BadMediaError(
            at, ref.field, ref.describe(), "not a readable image (unknown format or corrupt)"
        ) from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise BadMediaError(
            at, ref.field, ref.describe(), f"not a readable image ({exc})"
        ) from None


def load_image(ref: MediaRef, at: str) -> Image.Image:
    """The image ``ref`` names, fully decoded (RGB, or RGBA when it has alpha)."""
    if ref.data is not None:
        return _open_image(io.BytesIO(ref.data), at, ref)
    if ref.path is None:
        raise BadMediaError(at, ref.field, ref.describe(), "a frame list is not an image")
    if ref.path.is_dir():
        raise BadMediaError(at, ref.field, str(ref.path), "is a folder, not an image file")
    return _open_image(str(ref.path), at, ref)


def _frame_arrays(files: list[str], at: str, ref: MediaRef) -> list[np.ndarray]:
    frames = []
    for f in files:
        img = _open_image(f, at, MediaRef(ref.field, path=Path(f)))
        frames.append(np.asarray(img.convert("RGB")))
    return frames


def _decode_video(source: str | io.BytesIO, at: str, ref: MediaRef) -> Video:
    try:
        import av
    except ImportError:  # pragma: no cover - depends on the environment
        raise BadMediaError(
            at, ref.field, ref.describe(), "reading video files needs PyAV: pip install av"
        ) from None
    try:
        with av.open(source) as container:
            if not container.streams.video:
                raise BadMediaError(at, ref.field, ref.describe(), "has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    except FileNotFoundError:
        raise BadMediaError(at, ref.field, ref.describe(), "file not found") from None
    except av.FFmpegError as exc:
        raise BadMediaError(
            at, ref.field, ref.describe(), f"not a readable video ({exc})"
        ) from None
    if not frames:
        raise BadMediaError(at, ref.field, ref.describe(), "the video has no frames")
    if not rate:
        raise BadMediaError(at, ref.field, ref.describe(), "the video has no frame rate")
    return Video(frames, float(rate))


def _check_sizes(frames: list[np.ndarray], at: str, ref: MediaRef) -> None:
    sizes = sorted({f.shape[:2] for f in frames})
    if len(sizes) > 1:
        raise BadMediaError(at, ref.field, ref.describe(), f"frames differ in size {sizes}")


def load_video(ref: MediaRef, at: str, options: VideoOptions) -> Video:
    """All frames of the video ``ref`` names and its frame rate (frame images: ``frames_fps``)."""
    if ref.data is not None:
        video = _decode_video(io.BytesIO(ref.data), at, ref)
    elif ref.frames is not None:
        for f in ref.frames:
            if not f.is_file():
                raise BadMediaError(at, ref.field, str(f), "frame file not found")
        video = Video(_frame_arrays([str(f) for f in ref.frames], at, ref), options.frames_fps)
    elif ref.path is not None and ref.path.is_dir():
        files = sorted(
            p for p in ref.path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        )
        if not files:
            raise BadMediaError(at, ref.field, str(ref.path), "the frame folder holds no images")
        video = Video(_frame_arrays([str(f) for f in files], at, ref), options.frames_fps)
    elif ref.path is not None:
        video = _decode_video(str(ref.path), at, ref)
    else:  # pragma: no cover - MediaRef always has one source
        raise BadMediaError(at, ref.field, ref.describe(), "names no video")
    _check_sizes(video.frames, at, ref)
    return video
