"""Frame decoding that touches only what a sample needs, with a per-process LRU of decoders.

A request for timestamps ``[t0..tn]`` seeks to the keyframe at or before ``t0`` and decodes
forward until ``tn``; requests that are far apart (``reseek_gap_s``) seek again instead of
decoding the gap. Decoders stay open in a bounded LRU cache keyed by file; the cache notices a
``fork`` (DataLoader workers) and reopens files instead of sharing FFmpeg state across
processes.
"""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from av.video.reformatter import VideoReformatter

from longboat.embodied.data.layout import VideoDecodeError

BACKENDS = ("pyav", "torchcodec", "auto")


class FrameDecoder(Protocol):
    """What the dataset needs from a video backend."""

    frames_decoded: int
    """Frames the backend decoded so far (including frames decoded only to reach a target)."""

    def get_frames(self, timestamps: Sequence[float], tolerance_s: float) -> torch.Tensor:
        """uint8 [N,C,H,W] frames played at ``timestamps`` (seconds in the file)."""
        ...

    def close(self) -> None:
        """Release the file."""
        ...


def _nearest(found: dict[float, np.ndarray], ts: float) -> tuple[float, np.ndarray] | None:
    if not found:
        return None
    best = min(found, key=lambda f: abs(f - ts))
    return best, found[best]


class PyAVDecoder:
    """PyAV (FFmpeg) decoder for one file: keyframe seek + forward decode, nothing more."""

    def __init__(self, path: str | Path, *, reseek_gap_s: float = 1.0, threads: int = 1) -> None:
        import av

        self.path = Path(path)
        self.frames_decoded = 0
        self.reseek_gap_s = reseek_gap_s
        self._container = av.open(str(self.path))
        self._stream = self._container.streams.video[0]
        # Single-threaded by default: DataLoader workers already parallelise across samples.
        self._stream.thread_count = threads
        self._time_base = self._stream.time_base
        # Our own single-threaded swscale context: PyAV's default (threads=0) starts a slice
        # thread pool that a forked DataLoader worker inherits without its threads and then
        # waits on forever. One thread per worker is also the right budget.
        self._reformatter = VideoReformatter()

    def _decode_run(self, wanted: list[float], tolerance_s: float) -> dict[float, np.ndarray]:
        """Seek before wanted[0], decode forward to wanted[-1]; return {frame_ts: rgb HWC}."""
        # Seek to the last keyframe at or before the first wanted frame (which may sit up to
        # tolerance_s after its nominal timestamp).
        target_pts = max(int((wanted[0] + tolerance_s) / self._time_base), 0)
        found = self._decode_from(target_pts, wanted, tolerance_s)
        if found is None:
            # The demuxer landed after the target (inexact index, odd container): decode from
            # the start of the stream instead of returning a wrong or missing frame.
            found = self._decode_from(0, wanted, tolerance_s) or {}
        return found

    def _decode_from(
        self, seek_pts: int, wanted: list[float], tolerance_s: float
    ) -> dict[float, np.ndarray] | None:
        """Decode forward from a seek to ``seek_pts``; None if the seek overshot wanted[0]."""
        self._container.seek(seek_pts, stream=self._stream, backward=True)
        found: dict[float, np.ndarray] = {}
        first = True
        # Stop at the frame matching the last wanted timestamp (or the first one past it).
        last = wanted[-1] - tolerance_s
        for frame in self._container.decode(self._stream):
            self.frames_decoded += 1
            if frame.pts is None:
                continue
            ts = float(frame.pts * self._time_base)
            if first and ts > wanted[0] + tolerance_s and seek_pts > 0:
                return None
            first = False
            if any(abs(ts - w) <= tolerance_s for w in wanted):
                try:
                    rgb = self._reformatter.reformat(frame, format="rgb24", threads=1)
                except TypeError:  # PyAV < 16: no threads argument, swscale's default of one
                    rgb = self._reformatter.reformat(frame, format="rgb24")
                found[ts] = rgb.to_ndarray()
            if ts >= last:
                break
        if first and seek_pts > 0:
            return None  # nothing after the seek point: it overshot the end of the stream
        return found

    def get_frames(self, timestamps: Sequence[float], tolerance_s: float) -> torch.Tensor:
        """uint8 [N,C,H,W] frames at ``timestamps``; fails naming the file if one is absent."""
        wanted = sorted(set(float(t) for t in timestamps))
        runs: list[list[float]] = [[wanted[0]]]
        for ts in wanted[1:]:
            if ts - runs[-1][-1] > self.reseek_gap_s:
                runs.append([ts])
            else:
                runs[-1].append(ts)
        found: dict[float, np.ndarray] = {}
        for run in runs:
            found.update(self._decode_run(run, tolerance_s))
        out = []
        for ts in timestamps:
            hit = _nearest(found, float(ts))
            if hit is None or abs(hit[0] - ts) > tolerance_s:
                near = f"nearest decoded frame at {hit[0]:.6f}s" if hit else "no frame decoded"
                raise VideoDecodeError(
                    f"{self.path}: no frame at {ts:.6f}s within tolerance {tolerance_s}s "
                    f"({near}); the timestamp is beyond the video or the file is truncated"
                )
            out.append(hit[1])
        return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).contiguous()

    def close(self) -> None:
        """Close the container."""
        self._container.close()


class TorchCodecDecoder:
    """torchcodec decoder (optional extra ``longboat-embodied[torchcodec]``)."""

    def __init__(self, path: str | Path) -> None:
        from torchcodec.decoders import VideoDecoder

        self.path = Path(path)
        self.frames_decoded = 0
        self._decoder = VideoDecoder(str(self.path), seek_mode="approximate")

    def get_frames(self, timestamps: Sequence[float], tolerance_s: float) -> torch.Tensor:
        """uint8 [N,C,H,W] frames played at ``timestamps``, checked against ``tolerance_s``."""
        try:
            batch = self._decoder.get_frames_played_at(seconds=[float(t) for t in timestamps])
        except (RuntimeError, IndexError, ValueError) as exc:
            raise VideoDecodeError(
                f"{self.path}: torchcodec failed at {list(timestamps)}: {exc}"
            ) from exc
        # torchcodec does not report its internal decode count; count returned frames.
        self.frames_decoded += len(timestamps)
        for ts, pts in zip(timestamps, batch.pts_seconds.tolist(), strict=True):
            if abs(pts - ts) > tolerance_s:
                raise VideoDecodeError(
                    f"{self.path}: frame played at {ts:.6f}s has pts {pts:.6f}s, beyond "
                    f"tolerance {tolerance_s}s"
                )
        return batch.data

    def close(self) -> None:
        """Drop the decoder."""
        self._decoder = None


DecoderFactory = Callable[[Path], FrameDecoder]


def torchcodec_available() -> bool:
    """Whether the optional torchcodec backend can be imported."""
    return importlib.util.find_spec("torchcodec") is not None


def resolve_backend(video_backend: str | DecoderFactory) -> DecoderFactory:
    """``"pyav"``, ``"torchcodec"``, ``"auto"`` (torchcodec when importable) or a factory."""
    if callable(video_backend):
        return video_backend
    if video_backend not in BACKENDS:
        raise ValueError(
            f"video_backend={video_backend!r} is not one of {BACKENDS} (or a callable "
            "path -> decoder)"
        )
    if video_backend == "torchcodec" or (video_backend == "auto" and torchcodec_available()):
        if not torchcodec_available():
            raise ValueError(
                "video_backend='torchcodec' but torchcodec is not installed; install "
                "longboat-embodied[torchcodec] or use video_backend='pyav'"
            )
        return TorchCodecDecoder
    return PyAVDecoder


class DecoderCache:
    """Bounded LRU of open decoders, private to the process that opened them."""

    def __init__(self, factory: DecoderFactory, max_open: int = 8) -> None:
        if max_open < 1:
            raise ValueError(f"max_open_decoders={max_open} must be >= 1")
        self.factory = factory
        self.max_open = max_open
        self._pid = os.getpid()
        self._open: OrderedDict[Path, FrameDecoder] = OrderedDict()
        self.frames_decoded_closed = 0  # frames decoded by decoders already evicted
        self.opened = 0

    def get(self, path: Path) -> FrameDecoder:
        """The decoder for ``path``, opening it (and evicting the oldest) when needed."""
        if os.getpid() != self._pid:
            # Forked worker: the parent's FFmpeg contexts are not ours to use or close.
            self._open = OrderedDict()
            self._pid = os.getpid()
            self.frames_decoded_closed = 0
            self.opened = 0
        dec = self._open.get(path)
        if dec is not None:
            self._open.move_to_end(path)
            return dec
        dec = self.factory(path)
        self.opened += 1
        self._open[path] = dec
        while len(self._open) > self.max_open:
            _, old = self._open.popitem(last=False)
            self.frames_decoded_closed += old.frames_decoded
            old.close()
        return dec

    def drop(self, path: Path) -> None:
        """Close and forget ``path`` (after an error left its decoder in an unknown state)."""
        dec = self._open.pop(path, None)
        if dec is not None:
            self.frames_decoded_closed += dec.frames_decoded
            dec.close()

    @property
    def frames_decoded(self) -> int:
        """Frames decoded in this process, over all decoders ever opened."""
        return self.frames_decoded_closed + sum(d.frames_decoded for d in self._open.values())

    def __len__(self) -> int:
        return len(self._open)

    def __getstate__(self) -> dict:
        # Pickled into spawn workers: ship the recipe, not open FFmpeg handles.
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()
        return state
