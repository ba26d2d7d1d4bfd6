"""Read a LeRobot dataset's metadata (v2.1 or v3.0) into one layout-independent description."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from longboat.embodied.data.layout import (
    DEFAULT_CHUNK_SIZE,
    INFO_PATH,
    MODALITY_PATH,
    STATS_PATH,
    V21,
    V21_EPISODES_PATH,
    V21_TASKS_PATH,
    V30_TASKS_PATH,
    LeRobotFormatError,
    codebase_version,
    read_json,
    read_jsonl,
    read_parquet,
    read_parquet_schema,
)
from longboat.embodied.data.stats import stats_from_json


@dataclass(frozen=True)
class VideoSpan:
    """Where one episode's frames of one camera live: file and its start time in that file."""

    path: Path
    from_timestamp: float
    to_timestamp: float | None  # None for v2.1 (one file per episode, ends with the episode)


@dataclass(frozen=True)
class EpisodeMeta:
    """One episode: its length, tasks, global frame-index range and files."""

    index: int
    length: int
    tasks: tuple[str, ...]
    from_index: int
    to_index: int
    data_path: Path
    videos: dict[str, VideoSpan] = field(default_factory=dict)


@dataclass
class LeRobotMetadata:
    """Everything in ``meta/``: info, episodes, tasks, stats and GR00T's modality.json."""

    root: Path
    info: dict[str, Any]
    version: str
    episodes: list[EpisodeMeta]
    tasks: list[str]
    stats: dict[str, dict[str, np.ndarray]]
    modality: dict[str, Any] | None

    @property
    def fps(self) -> int:
        """Frames per second of every stream in the dataset."""
        return int(self.info["fps"])

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        """info.json features ({dtype, shape, names, info?})."""
        return self.info["features"]

    @property
    def video_keys(self) -> list[str]:
        """Features stored as mp4 video."""
        return [k for k, ft in self.features.items() if ft["dtype"] == "video"]

    @property
    def image_keys(self) -> list[str]:
        """Features stored as encoded images inside the parquet files."""
        return [k for k, ft in self.features.items() if ft["dtype"] == "image"]

    @property
    def info_path(self) -> Path:
        """Path of meta/info.json (named in errors)."""
        return self.root / INFO_PATH

    @classmethod
    def load(cls, root: str | Path) -> LeRobotMetadata:
        """Load and check ``root/meta``; errors name the file (and episode) that is wrong."""
        root = Path(root)
        info_path = root / INFO_PATH
        info = read_json(info_path)
        if not isinstance(info, dict):
            raise LeRobotFormatError(
                f"{info_path}: expected a JSON object, got {type(info).__name__}"
            )
        version = codebase_version(info, info_path)
        _check_info(info, info_path)
        if version == V21:
            episodes, tasks = _load_v21(root, info)
        else:
            episodes, tasks = _load_v30(root, info)
        stats_path = root / STATS_PATH
        stats = _load_stats(stats_path) if stats_path.is_file() else {}
        modality_path = root / MODALITY_PATH
        modality = read_json(modality_path) if modality_path.is_file() else None
        return cls(root, info, version, episodes, tasks, stats, modality)


def _load_stats(path: Path) -> dict[str, dict[str, np.ndarray]]:
    data = read_json(path)
    if not isinstance(data, dict):
        raise LeRobotFormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        return stats_from_json(data)
    except (TypeError, ValueError) as exc:
        raise LeRobotFormatError(f"{path}: stats are not numeric arrays ({exc})") from exc


def _check_info(info: dict[str, Any], info_path: Path) -> None:
    """The info.json keys the reader relies on, each with the type it needs."""
    for key in ("fps", "features", "data_path"):
        if key not in info:
            raise LeRobotFormatError(f"{info_path}: missing required key {key!r}")
    fps = info["fps"]
    if isinstance(fps, bool) or not isinstance(fps, int | float) or fps <= 0 or fps != int(fps):
        raise LeRobotFormatError(f"{info_path}: 'fps' must be a positive integer, got {fps!r}")
    if not isinstance(info["features"], dict) or not info["features"]:
        raise LeRobotFormatError(
            f"{info_path}: 'features' must be a non-empty object, got {info['features']!r}"
        )
    for key, ft in info["features"].items():
        if not isinstance(ft, dict) or "dtype" not in ft or "shape" not in ft:
            raise LeRobotFormatError(
                f"{info_path}: feature {key!r} must be a dict with 'dtype' and 'shape', got {ft!r}"
            )
        shape = ft["shape"]
        if not isinstance(shape, list | tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape
        ):
            raise LeRobotFormatError(
                f"{info_path}: feature {key!r} has shape {shape!r}; expected a list of "
                "positive integers"
            )
    for key in ("data_path", "video_path"):
        if info.get(key) is not None and not isinstance(info[key], str):
            raise LeRobotFormatError(
                f"{info_path}: {key!r} must be a path template string, got {info[key]!r}"
            )


def _format_path(info: dict[str, Any], key: str, root: Path, **fields: Any) -> Path:
    """``root / info[key].format(**fields)``, naming info.json when the template is wrong or
    the path it gives leads outside the dataset root (``..``, an absolute path elsewhere)."""
    try:
        path = root / info[key].format(**fields)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise LeRobotFormatError(
            f"{root / INFO_PATH}: {key} template {info[key]!r} cannot be filled with "
            f"{sorted(fields)} ({type(exc).__name__}: {exc})"
        ) from exc
    base = os.path.abspath(root)
    if os.path.commonpath([base, os.path.abspath(path)]) != base:
        raise LeRobotFormatError(
            f"{root / INFO_PATH}: {key} template {info[key]!r} gives {os.path.abspath(path)}, "
            f"outside the dataset root {base}; a dataset's files lie under its root (a damaged "
            "or crafted info.json)"
        )
    return path


def _video_keys(info: dict[str, Any]) -> list[str]:
    return [k for k, ft in info["features"].items() if ft["dtype"] == "video"]


def _load_v21(root: Path, info: dict[str, Any]) -> tuple[list[EpisodeMeta], list[str]]:
    tasks_path, episodes_path = root / V21_TASKS_PATH, root / V21_EPISODES_PATH
    task_rows = _rows_with(read_jsonl(tasks_path), tasks_path, ("task_index", "task"))
    tasks_by_index = {int(r["task_index"]): r["task"] for r in task_rows}
    tasks = [tasks_by_index[i] for i in sorted(tasks_by_index)]
    rows = _rows_with(read_jsonl(episodes_path), episodes_path, ("episode_index", "length"))
    rows = sorted(rows, key=lambda r: int(r["episode_index"]))
    chunks_size = int(info.get("chunks_size", DEFAULT_CHUNK_SIZE))
    video_keys = _video_keys(info)
    if video_keys and not info.get("video_path"):
        raise LeRobotFormatError(
            f"{root / INFO_PATH}: features {video_keys} are videos but 'video_path' is empty"
        )
    episodes, start = [], 0
    for row in rows:
        ep, length = int(row["episode_index"]), int(row["length"])
        chunk = ep // chunks_size
        data_path = _format_path(info, "data_path", root, episode_chunk=chunk, episode_index=ep)
        videos = {
            key: VideoSpan(
                _format_path(
                    info, "video_path", root, episode_chunk=chunk, video_key=key, episode_index=ep
                ),
                0.0,
                None,
            )
            for key in video_keys
        }
        episodes.append(
            EpisodeMeta(
                ep, length, tuple(row.get("tasks", ())), start, start + length, data_path, videos
            )
        )
        start += length
    return episodes, tasks


def _rows_with(rows: list[Any], path: Path, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """JSON-lines rows that each hold ``keys`` with integer-like index/length values."""
    for lineno, row in enumerate(rows, start=1):
        missing = [k for k in keys if not isinstance(row, dict) or k not in row]
        if missing:
            raise LeRobotFormatError(f"{path}: row {lineno} lacks {missing} (got {row!r})")
        for key in keys:
            if key != "task" and not _is_int(row[key]):
                raise LeRobotFormatError(
                    f"{path}: row {lineno} has {key}={row[key]!r}; expected an integer"
                )
    return rows


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_v30_tasks(root: Path) -> list[str]:
    path = root / V30_TASKS_PATH
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: file not found (v3.0 datasets keep their tasks here)")
    table = read_parquet(path, "the task table")
    names = table.column_names
    # LeRobot writes a pandas frame indexed by the task string; the index lands in a column
    # named "task" (or "__index_level_0__" when the index was left unnamed).
    task_col = "task" if "task" in names else "__index_level_0__"
    if task_col not in names or "task_index" not in names:
        raise LeRobotFormatError(f"{path}: expected columns 'task' and 'task_index', found {names}")
    by_index = dict(
        zip(table.column("task_index").to_pylist(), table.column(task_col).to_pylist(), strict=True)
    )
    return [by_index[i] for i in sorted(by_index)]


def _load_v30(root: Path, info: dict[str, Any]) -> tuple[list[EpisodeMeta], list[str]]:
    tasks = _read_v30_tasks(root)
    files = sorted((root / "meta/episodes").glob("*/*.parquet"))
    if not files:
        raise LeRobotFormatError(
            f"{root / 'meta/episodes'}: no chunk-*/file-*.parquet episode tables found"
        )
    video_keys = _video_keys(info)
    if video_keys and not info.get("video_path"):
        raise LeRobotFormatError(
            f"{root / INFO_PATH}: features {video_keys} are videos but 'video_path' is empty"
        )
    needed = ["episode_index", "length", "tasks", "data/chunk_index", "data/file_index"]
    needed += ["dataset_from_index", "dataset_to_index"]
    for key in video_keys:
        needed += [f"videos/{key}/{c}" for c in ("chunk_index", "file_index")]
        needed += [f"videos/{key}/{c}" for c in ("from_timestamp", "to_timestamp")]
    episodes = []
    for path in files:
        schema_names = read_parquet_schema(path, "an episode table").names
        missing = [c for c in needed if c not in schema_names]
        if missing:
            raise LeRobotFormatError(
                f"{path}: episode table lacks columns {missing} (video keys come from "
                f"{root / INFO_PATH})"
            )
        cols = read_parquet(path, "an episode table", columns=needed).to_pydict()
        for i, ep in enumerate(cols["episode_index"]):
            data_path = _format_path(
                info,
                "data_path",
                root,
                chunk_index=cols["data/chunk_index"][i],
                file_index=cols["data/file_index"][i],
            )
            videos = {}
            for key in video_keys:
                vpath = _format_path(
                    info,
                    "video_path",
                    root,
                    video_key=key,
                    chunk_index=cols[f"videos/{key}/chunk_index"][i],
                    file_index=cols[f"videos/{key}/file_index"][i],
                )
                videos[key] = VideoSpan(
                    vpath,
                    float(cols[f"videos/{key}/from_timestamp"][i]),
                    float(cols[f"videos/{key}/to_timestamp"][i]),
                )
            episodes.append(
                EpisodeMeta(
                    int(ep),
                    int(cols["length"][i]),
                    tuple(cols["tasks"][i] or ()),
                    int(cols["dataset_from_index"][i]),
                    int(cols["dataset_to_index"][i]),
                    data_path,
                    videos,
                )
            )
    episodes.sort(key=lambda e: e.index)
    for ep in episodes:
        if ep.to_index - ep.from_index != ep.length:
            raise LeRobotFormatError(
                f"{files[0].parent.parent}: episode {ep.index} has length {ep.length} but index "
                f"range [{ep.from_index}, {ep.to_index})"
            )
    return episodes, tasks
