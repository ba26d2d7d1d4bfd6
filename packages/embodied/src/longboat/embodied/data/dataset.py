"""``LeRobotDataset``: map-style torch dataset over a LeRobot v2.1 or v3.0 dataset on disk."""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from longboat.embodied.data.layout import (
    DEFAULT_FEATURES,
    STATS_PATH,
    LeRobotFormatError,
    VideoDecodeError,
    read_parquet,
    read_parquet_schema,
)
from longboat.embodied.data.metadata import EpisodeMeta, LeRobotMetadata
from longboat.embodied.data.normalize import Normalizer
from longboat.embodied.data.range_check import FAR_OUTSIDE_FACTOR, far_outside_stats
from longboat.embodied.data.video_decode import DecoderCache, DecoderFactory, resolve_backend

log = logging.getLogger(__name__)

EMBODIMENT_KEY = "embodiment_id"


def delta_indices(
    delta_timestamps: Mapping[str, Sequence[float]], fps: int, tolerance_s: float
) -> dict[str, np.ndarray]:
    """Frame offsets for each key; every delta must be a multiple of 1/fps within tolerance."""
    out = {}
    for key, deltas in delta_timestamps.items():
        offsets = np.array([round(d * fps) for d in deltas], dtype=np.int64)
        bad = [d for d, o in zip(deltas, offsets, strict=True) if abs(d - o / fps) > tolerance_s]
        if bad or len(offsets) == 0:
            raise ValueError(
                f"delta_timestamps[{key!r}]={list(deltas)}: values {bad or '(empty)'} are not "
                f"multiples of 1/{fps}s within {tolerance_s}s; use k/{fps} for integer k"
            )
        out[key] = offsets
    return out


class LeRobotDataset(torch.utils.data.Dataset):
    """One LeRobot dataset (layout detected from ``meta/info.json``'s ``codebase_version``).

    ``dataset[i]`` (i over the selected episodes' frames, in episode order) returns a dict:
    every parquet feature as a tensor (``observation.state`` [D], ``action`` [D],
    ``timestamp``, ``frame_index``, ``episode_index``, ``index``, ``task_index``), each camera
    as [C,H,W] (uint8 or float32 in [0,1]), ``task`` (str) and ``embodiment_id`` when known.
    A key in ``delta_timestamps`` comes back stacked over its deltas ([T,D] / [T,C,H,W]) with
    ``<key>_is_pad`` [T] marking offsets that fell outside the episode (clamped to its ends).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        episodes: Sequence[int] | None = None,
        delta_timestamps: Mapping[str, Sequence[float]] | None = None,
        video_backend: Literal["pyav", "torchcodec", "auto"] | DecoderFactory = "pyav",
        image_dtype: Literal["float32", "uint8"] = "float32",
        camera_keys: Sequence[str] | None = None,
        normalization: Normalizer | Mapping[str, str] | None = None,
        tolerance_s: float = 1e-4,
        skip_bad_samples: bool = False,
        max_open_decoders: int = 8,
        embodiment_id: int | None = None,
    ) -> None:
        """Load metadata and the (non-video) frame table; check files before any decoding.

        ``normalization`` is a :class:`Normalizer` or ``{key_or_group: mode}`` built from the
        dataset's stats.json / modality.json; ``camera_keys`` selects cameras (default all);
        ``embodiment_id`` overrides/sets the id when the dataset has no ``embodiment_id``
        column. Values far outside stats.json's range (``range_check``: a corrupt file) fail
        here naming file, episode, frame and feature; ``skip_bad_samples`` instead skips such
        frames (``self.bad_frames`` of them) and failed decodes, counting each skip in
        ``self.skipped``.
        """
        if image_dtype not in ("float32", "uint8"):
            raise ValueError(f"image_dtype={image_dtype!r}: use 'float32' or 'uint8'")
        self.meta = LeRobotMetadata.load(root)
        self.root = self.meta.root
        self.fps = self.meta.fps
        self.tolerance_s = tolerance_s
        self.image_dtype = image_dtype
        self.skip_bad_samples = skip_bad_samples
        self.skipped = 0
        features = self.meta.features
        all_cams = self.meta.video_keys + self.meta.image_keys
        self.camera_keys = list(all_cams if camera_keys is None else camera_keys)
        for key in self.camera_keys:
            if key not in all_cams:
                raise LeRobotFormatError(
                    f"{self.meta.info_path}: camera {key!r} is not a video or image feature "
                    f"(camera features: {all_cams})"
                )
        self.video_keys = [k for k in self.camera_keys if k in self.meta.video_keys]
        # Image features live in the parquet as {bytes, path} structs (HF datasets' Image).
        self.image_keys = [k for k in self.camera_keys if k in self.meta.image_keys]
        self.delta_timestamps = dict(delta_timestamps or {})
        for key in self.delta_timestamps:
            if key not in features:
                raise LeRobotFormatError(
                    f"{self.meta.info_path}: delta_timestamps key {key!r} is missing from "
                    f"info.json features ({sorted(features)}); fix the key"
                )
        self._deltas = delta_indices(self.delta_timestamps, self.fps, tolerance_s)
        self.episodes = self._select_episodes(episodes)
        self.column_keys = [
            k for k, ft in features.items() if ft["dtype"] not in ("video", "image")
        ]
        self._read_keys = self.column_keys + self.image_keys
        self._columns, self._ep_start = self._load_columns()
        self._row_episode = np.repeat(
            np.arange(len(self.episodes)), [ep.length for ep in self.episodes]
        )
        self._check_timestamps()
        self._check_video_files()
        self._bad_rows = self._check_values()
        self.bad_frames = int(self._bad_rows.sum())
        """Frames with values far outside stats.json (skipped; 0 unless skip_bad_samples)."""
        self.embodiment_id = embodiment_id
        if isinstance(normalization, Normalizer) or normalization is None:
            self.normalizer = normalization
        else:
            self.normalizer = Normalizer(
                self.meta.stats, normalization, modality=self.meta.modality
            )
        self.decoders = DecoderCache(resolve_backend(video_backend), max_open_decoders)

    # ------------------------------------------------------------------ loading and checks
    def _select_episodes(self, episodes: Sequence[int] | None) -> list[EpisodeMeta]:
        by_index = {ep.index: ep for ep in self.meta.episodes}
        if episodes is None:
            return list(self.meta.episodes)
        missing = [e for e in episodes if e not in by_index]
        if missing:
            raise ValueError(
                f"episodes {missing} are not in {self.root} (it has {len(by_index)} episodes)"
            )
        return [by_index[e] for e in sorted(set(episodes))]

    def _load_columns(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Read every selected episode's rows once; per-key numpy arrays in episode order."""
        by_file: dict[Path, list[EpisodeMeta]] = {}
        for ep in self.episodes:
            by_file.setdefault(ep.data_path, []).append(ep)
        parts: dict[int, dict[str, np.ndarray]] = {}
        for path, eps in by_file.items():
            ep_names = ", ".join(str(e.index) for e in eps[:5])
            if not path.is_file():
                raise LeRobotFormatError(f"{path}: data file missing (episode {ep_names})")
            where = f"episode {ep_names}"
            names = read_parquet_schema(path, where).names
            missing = [k for k in self.column_keys if k not in names]
            if missing:
                raise LeRobotFormatError(
                    f"{path}: columns {missing} declared in {self.meta.info_path} are missing "
                    f"(episode {ep_names})"
                )
            extra = [k for k in names if k not in self.meta.features]
            if extra:
                raise LeRobotFormatError(
                    f"{path}: columns {extra} are missing from {self.meta.info_path} features "
                    f"(episode {ep_names}); add them to info.json or drop them"
                )
            table = read_parquet(path, where, columns=self._read_keys)
            try:
                cols = {k: _column_to_numpy(table.column(k)) for k in self.column_keys}
            except (ValueError, TypeError) as exc:  # e.g. ragged lists after corruption
                raise LeRobotFormatError(
                    f"{path}: columns cannot be read as arrays ({where}): {exc}"
                ) from exc
            cols.update({k: _image_bytes(table.column(k), path) for k in self.image_keys})
            ep_col = cols["episode_index"]
            for ep in eps:
                rows = np.flatnonzero(ep_col == ep.index)
                if len(rows) != ep.length:
                    raise LeRobotFormatError(
                        f"{path}: episode {ep.index} has {len(rows)} rows but its metadata "
                        f"says length {ep.length}"
                    )
                order = rows[np.argsort(cols["frame_index"][rows], kind="stable")]
                parts[ep.index] = {k: v[order] for k, v in cols.items()}
        columns = {
            k: np.concatenate([parts[ep.index][k] for ep in self.episodes]) for k in self._read_keys
        }
        starts = np.cumsum([0] + [ep.length for ep in self.episodes])[:-1]
        return columns, starts

    def _check_timestamps(self) -> None:
        ts, fi = self._columns["timestamp"], self._columns["frame_index"]
        for i, ep in enumerate(self.episodes):
            s = self._ep_start[i]
            ep_ts, ep_fi = ts[s : s + ep.length], fi[s : s + ep.length]
            expected = np.arange(ep.length)
            if not np.array_equal(ep_fi, expected):
                raise LeRobotFormatError(
                    f"{ep.data_path}: episode {ep.index} frame_index is not 0..{ep.length - 1}"
                )
            off = np.abs(ep_ts.astype(np.float64) - expected / self.fps)
            if off.max(initial=0.0) > self.tolerance_s:
                j = int(off.argmax())
                raise LeRobotFormatError(
                    f"{ep.data_path}: episode {ep.index} frame {j} has timestamp {ep_ts[j]:.6f}s, "
                    f"expected {j / self.fps:.6f}s (beyond the episode's 1/fps grid, "
                    f"fps={self.fps}, tolerance {self.tolerance_s}s)"
                )
            for key in self.video_keys:
                span = ep.videos[key]
                end = span.from_timestamp + ep.length / self.fps
                if span.to_timestamp is not None and end > span.to_timestamp + self.tolerance_s:
                    raise LeRobotFormatError(
                        f"{span.path}: episode {ep.index} needs frames up to "
                        f"{end - 1 / self.fps:.6f}s but its video span ends at "
                        f"{span.to_timestamp:.6f}s (timestamps beyond the episode)"
                    )

    def _check_values(self) -> np.ndarray:
        """Rows with a task_index outside meta/tasks or a value far outside stats.json (once,
        vectorised); they fail the dataset unless ``skip_bad_samples``."""
        keys = [k for k in self.column_keys if k not in DEFAULT_FEATURES]
        bad, found = far_outside_stats(self._columns, self.meta.stats, keys)
        problems = [
            (
                v.row,
                f"{v.key}[{v.dim}] = {v.value:.6g} is far outside the dataset's range "
                f"[{v.low:.6g}, {v.high:.6g}] in {self.root / STATS_PATH} (more than "
                f"{FAR_OUTSIDE_FACTOR:g}x the range beyond it; {v.rows} frame(s) like it)",
            )
            for v in found
        ]
        tasks = self._columns["task_index"].reshape(-1)
        bad_task = (tasks < 0) | (tasks >= len(self.meta.tasks))
        if bad_task.any():
            bad |= bad_task
            row = int(np.flatnonzero(bad_task)[0])
            problems.append(
                (
                    row,
                    f"task_index = {int(tasks[row])} is not among the "
                    f"{len(self.meta.tasks)} tasks of the dataset's task table "
                    f"({int(bad_task.sum())} frame(s) like it)",
                )
            )
        if not problems:
            return bad
        lines = []
        for row, what in sorted(problems):
            ep_i = int(self._row_episode[row])
            ep = self.episodes[ep_i]
            frame = row - int(self._ep_start[ep_i])
            lines.append(f"{ep.data_path}: episode {ep.index}, frame {frame}: {what}")
        if not self.skip_bad_samples:
            raise LeRobotFormatError(
                "; ".join(lines) + ". The file is likely corrupt: copy or export it again, or "
                "skip such frames with skip_bad_samples (data.skip_bad_samples=true)"
            )
        log.warning("skipping %d frame(s) with bad values: %s", int(bad.sum()), "; ".join(lines))
        return bad

    def _reads_bad_row(self, pos: int) -> bool:
        """Whether sample ``pos`` reads a bad row (its own or one of its delta rows)."""
        if self._bad_rows[pos]:
            return True
        ep_i = int(self._row_episode[pos])
        start, length = int(self._ep_start[ep_i]), self.episodes[ep_i].length
        return any(
            self._bad_rows[start + self._delta_rows(pos - start, length, offsets)[0]].any()
            for offsets in self._deltas.values()
        )

    def _check_video_files(self) -> None:
        missing: dict[Path, list[str]] = {}
        for ep in self.episodes:
            for key in self.video_keys:
                path = ep.videos[key].path
                if not path.is_file():
                    missing.setdefault(path, []).append(f"{ep.index} ({key})")
        for path, eps in missing.items():
            msg = f"{path}: video file missing (episode {', '.join(eps)})"
            if not self.skip_bad_samples:
                raise LeRobotFormatError(msg)
            log.warning("%s; its samples will be skipped", msg)

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self._row_episode)

    @property
    def num_episodes(self) -> int:
        """Selected episodes."""
        return len(self.episodes)

    @property
    def episode_ranges(self) -> list[tuple[int, int]]:
        """[start, end) sample positions of each selected episode (for samplers)."""
        return [
            (int(s), int(s) + ep.length)
            for s, ep in zip(self._ep_start, self.episodes, strict=True)
        ]

    @property
    def frames_decoded(self) -> int:
        """Video frames decoded in this process so far."""
        return self.decoders.frames_decoded

    def __getitem__(self, idx: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} out of range for dataset of {n} frames")
        idx %= n
        for attempt in range(n):
            pos = (idx + attempt) % n
            if self.bad_frames and self._reads_bad_row(pos):
                self.skipped += 1
                continue
            try:
                return self._get(pos)
            except (VideoDecodeError, OSError) as exc:
                if not self.skip_bad_samples:
                    raise
                self.skipped += 1
                log.warning("skipping sample %d: %s", pos, exc)
        raise VideoDecodeError(f"{self.root}: every sample failed to decode or has bad values")

    def _get(self, pos: int) -> dict[str, Any]:
        ep_i = int(self._row_episode[pos])
        ep = self.episodes[ep_i]
        start = int(self._ep_start[ep_i])
        frame = pos - start
        item: dict[str, Any] = {}
        for key in self.column_keys:
            if key in self._deltas:
                rows, pad = self._delta_rows(frame, ep.length, self._deltas[key])
                item[key] = torch.from_numpy(self._columns[key][start + rows])
                item[f"{key}_is_pad"] = torch.from_numpy(pad)
            else:
                # A copy: a caller editing the sample in place must not edit the dataset.
                item[key] = torch.from_numpy(np.array(self._columns[key][pos]))
        for key in self.camera_keys:
            if key in self._deltas:
                rows, pad = self._delta_rows(frame, ep.length, self._deltas[key])
                item[key] = self._frames(ep, key, start + rows)
                item[f"{key}_is_pad"] = torch.from_numpy(pad)
            else:
                item[key] = self._frames(ep, key, np.array([pos]))[0]
        item["task"] = self.meta.tasks[int(self._columns["task_index"][pos])]
        if self.embodiment_id is not None:
            item[EMBODIMENT_KEY] = torch.tensor(self.embodiment_id, dtype=torch.int64)
        if self.normalizer is not None:
            item = self.normalizer(item)
        return item

    @staticmethod
    def _delta_rows(frame: int, length: int, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        target = frame + offsets
        return np.clip(target, 0, length - 1), (target < 0) | (target >= length)

    def _frames(self, ep: EpisodeMeta, key: str, rows: np.ndarray) -> torch.Tensor:
        """[T,C,H,W] frames of camera ``key`` at dataset rows ``rows`` (one episode)."""
        if key in self.video_keys:
            frames = self._decode(ep, key, self._columns["timestamp"][rows])
        else:
            frames = torch.stack([self._image(ep, key, int(r)) for r in rows])
        if self.image_dtype == "float32":
            return frames.to(torch.float32).div_(255.0)
        return frames

    def _image(self, ep: EpisodeMeta, key: str, row: int) -> torch.Tensor:
        from PIL import Image

        data = self._columns[key][row]
        try:
            with Image.open(io.BytesIO(data)) as img:
                arr = np.asarray(img.convert("RGB"))
        except Exception as exc:
            raise VideoDecodeError(
                f"{ep.data_path}: image {key!r} of episode {ep.index}, frame "
                f"{row - self._ep_start[self.episodes.index(ep)]} cannot be decoded: {exc}"
            ) from exc
        return torch.from_numpy(arr.copy()).permute(2, 0, 1)

    def _decode(self, ep: EpisodeMeta, key: str, timestamps: np.ndarray) -> torch.Tensor:
        span = ep.videos[key]
        file_ts = [span.from_timestamp + float(t) for t in timestamps]
        if not span.path.is_file():
            raise VideoDecodeError(f"{span.path}: video file missing (episode {ep.index}, {key})")
        try:
            frames = self.decoders.get(span.path).get_frames(file_ts, self.tolerance_s)
        except VideoDecodeError as exc:
            self.decoders.drop(span.path)
            raise VideoDecodeError(f"episode {ep.index}, camera {key}: {exc}") from exc
        except Exception as exc:  # FFmpeg errors come as several types; name the file.
            self.decoders.drop(span.path)
            raise VideoDecodeError(
                f"{span.path}: decode failed (episode {ep.index}, camera {key}, "
                f"timestamps {file_ts}): {exc}"
            ) from exc
        return frames


def _image_bytes(column: Any, path: Path) -> np.ndarray:
    """HF ``Image`` column (struct of bytes and path) -> object array of encoded bytes."""
    import pyarrow as pa

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_struct(arr.type) and arr.type.get_field_index("bytes") >= 0:
        arr = arr.field("bytes")
    if not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):
        raise LeRobotFormatError(
            f"{path}: image column has type {arr.type}; expected struct<bytes, path> or binary "
            "(images stored as files outside the parquet are not supported)"
        )
    out = np.empty(len(arr), dtype=object)
    out[:] = arr.to_pylist()
    return out


def _column_to_numpy(column: Any) -> np.ndarray:
    """Arrow column (scalars or fixed/variable-size lists) -> numpy [N] or [N, D]."""
    import pyarrow as pa

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_fixed_size_list(arr.type) or pa.types.is_list(arr.type):
        n = len(arr)
        flat = arr.flatten().to_numpy(zero_copy_only=False)
        return flat.reshape(n, -1) if n else flat.reshape(0, 0)
    return arr.to_numpy(zero_copy_only=False)
