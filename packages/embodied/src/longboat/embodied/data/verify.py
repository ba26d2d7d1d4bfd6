"""A startup scan of a LeRobot dataset's files (``data.verify=true``): every data file reads
in full, every video opens, decodes its first frame and holds the frames its episodes need.

Opt-in because it reads every byte of the data files and demuxes every video (no decode past
the first frame); the loader itself reads only the columns and frames a run uses. Problems
are collected over the whole dataset, not only the first, and named by file and episode.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from longboat.embodied.data.layout import LeRobotFormatError, read_parquet
from longboat.embodied.data.metadata import EpisodeMeta, LeRobotMetadata


@dataclass
class VerifyReport:
    """What the scan checked and what it found."""

    data_files: int = 0
    video_files: int = 0
    episodes: int = 0
    frames: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        """One line: counts, then ``no problems`` or how many."""
        found = "no problems" if not self.problems else f"{len(self.problems)} problem(s)"
        return (
            f"data.verify: {self.data_files} data file(s), {self.video_files} video file(s), "
            f"{self.episodes} episode(s), {self.frames} frame(s) checked in "
            f"{self.seconds:.1f}s: {found}"
        )

    def raise_if_problems(self) -> None:
        """``LeRobotFormatError`` listing every problem (one per line)."""
        if self.problems:
            raise LeRobotFormatError(
                f"{self.summary()}:\n" + "\n".join(f"  - {p}" for p in self.problems)
            )

    def merge(self, other: VerifyReport) -> None:
        """Add another dataset's counts and problems (sub-datasets of one run)."""
        self.data_files += other.data_files
        self.video_files += other.video_files
        self.episodes += other.episodes
        self.frames += other.frames
        self.problems += other.problems
        self.seconds += other.seconds


def _names(eps: Sequence[EpisodeMeta]) -> str:
    shown = ", ".join(str(e.index) for e in eps[:5])
    return shown + (f", ... ({len(eps)} episodes)" if len(eps) > 5 else "")


def _check_data_file(path: Path, eps: list[EpisodeMeta]) -> list[str]:
    where = f"episode {_names(eps)}"
    if not path.is_file():
        return [f"{path}: data file missing ({where})"]
    try:
        table = read_parquet(path, where)
    except LeRobotFormatError as exc:
        return [str(exc)]
    if "episode_index" not in table.column_names:
        return [f"{path}: no episode_index column ({where})"]
    try:
        col = table.column("episode_index").to_numpy()
    except Exception as exc:  # a damaged column can fail in several arrow types
        return [f"{path}: episode_index column unreadable ({where}): {exc}"]
    problems = []
    for ep in eps:
        rows = int(np.count_nonzero(col == ep.index))
        if rows != ep.length:
            problems.append(
                f"{path}: episode {ep.index} has {rows} rows but its metadata says length "
                f"{ep.length}"
            )
    return problems


def _scan_video(path: Path) -> tuple[int, float]:
    """(frames, last frame's timestamp in seconds) from the demuxed packets; the first frame
    is decoded, so a file whose codec cannot start fails here."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        next(iter(container.decode(stream)))  # StopIteration: no frame at all
        container.seek(0, stream=stream, backward=True)
        frames, last = 0, -1.0
        for packet in container.demux(stream):
            if packet.pts is None or packet.size == 0:
                continue
            frames += 1
            last = max(last, float(packet.pts * stream.time_base))
    return frames, last


def _check_video_file(
    path: Path, spans: list[tuple[EpisodeMeta, str, float]], fps: int, tolerance_s: float
) -> list[str]:
    """``spans``: (episode, camera, start time in the file) of every episode stored in it."""
    eps = [ep for ep, _, _ in spans]
    where = f"episode {_names(eps)}, camera {spans[0][1]}"
    if not path.is_file():
        return [f"{path}: video file missing ({where})"]
    try:
        frames, last = _scan_video(path)
    except StopIteration:
        return [f"{path}: video holds no frame ({where})"]
    except Exception as exc:  # FFmpeg errors come as several types
        return [f"{path}: video cannot be opened or decoded ({where}): {exc}"]
    needed = sum(ep.length for ep in eps)
    if frames < needed:
        return [
            f"{path}: video holds {frames} frames but episode {_names(eps)} need {needed} "
            f"(camera {spans[0][1]}; truncated?)"
        ]
    for ep, cam, start in spans:
        end = start + (ep.length - 1) / fps
        if last + tolerance_s < end:
            return [
                f"{path}: episode {ep.index} ({cam}) needs frames up to {end:.6f}s but the "
                f"video ends at {last:.6f}s (timestamps beyond the video)"
            ]
    return []


def verify_dataset(
    meta: LeRobotMetadata,
    *,
    episodes: Sequence[EpisodeMeta] | None = None,
    video_keys: Sequence[str] | None = None,
    tolerance_s: float = 1e-4,
) -> VerifyReport:
    """Scan the data and video files of ``episodes`` (default all) for cameras ``video_keys``
    (default every video feature); returns the report (``raise_if_problems`` to fail)."""
    t0 = time.perf_counter()
    eps = list(meta.episodes if episodes is None else episodes)
    keys = list(meta.video_keys if video_keys is None else video_keys)
    report = VerifyReport(episodes=len(eps), frames=sum(ep.length for ep in eps))
    by_file: dict[Path, list[EpisodeMeta]] = {}
    videos: dict[Path, list[tuple[EpisodeMeta, str, float]]] = {}
    for ep in eps:
        by_file.setdefault(ep.data_path, []).append(ep)
        for key in keys:
            span = ep.videos[key]
            videos.setdefault(span.path, []).append((ep, key, span.from_timestamp))
    for path, file_eps in by_file.items():
        report.problems += _check_data_file(path, file_eps)
    for path, spans in videos.items():
        report.problems += _check_video_file(path, spans, meta.fps, tolerance_s)
    report.data_files, report.video_files = len(by_file), len(videos)
    report.seconds = time.perf_counter() - t0
    return report


__all__ = ["VerifyReport", "verify_dataset"]
