"""Read a LeRobot dataset's metadata (v2.1 or v3.0) into one layout-independent description."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

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
        version = codebase_version(info, info_path)
        for key in ("fps", "features", "data_path"):
            if key not in info:
                raise LeRobotFormatError(f"{info_path}: missing required key {key!r}")
        for key, ft in info["features"].items():
            if not isinstance(ft, dict) or "dtype" not in ft or "shape" not in ft:
                raise LeRobotFormatError(
                    f"{info_path}: feature {key!r} must be a dict with 'dtype' and 'shape', "
                    f"got {ft!r}"
                )
        if version == V21:
            episodes, tasks = _load_v21(root, info)
        else:
            episodes, tasks = _load_v30(root, info)
        stats_path = root / STATS_PATH
        stats = stats_from_json(read_json(stats_path)) if stats_path.is_file() else {}
        modality_path = root / MODALITY_PATH
        modality = read_json(modality_path) if modality_path.is_file() else None
        return cls(root, info, version, episodes, tasks, stats, modality)


def _video_keys(info: dict[str, Any]) -> list[str]:
    return [k for k, ft in info["features"].items() if ft["dtype"] == "video"]


def _load_v21(root: Path, info: dict[str, Any]) -> tuple[list[EpisodeMeta], list[str]]:
    task_rows = read_jsonl(root / V21_TASKS_PATH)
    tasks_by_index = {int(r["task_index"]): r["task"] for r in task_rows}
    tasks = [tasks_by_index[i] for i in sorted(tasks_by_index)]
    rows = sorted(read_jsonl(root / V21_EPISODES_PATH), key=lambda r: int(r["episode_index"]))
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
        data_path = root / info["data_path"].format(episode_chunk=chunk, episode_index=ep)
        videos = {
            key: VideoSpan(
                root
                / info["video_path"].format(episode_chunk=chunk, video_key=key, episode_index=ep),
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


def _read_v30_tasks(root: Path) -> list[str]:
    path = root / V30_TASKS_PATH
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: file not found (v3.0 datasets keep their tasks here)")
    table = pq.read_table(path)
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
        schema_names = pq.read_schema(path).names
        missing = [c for c in needed if c not in schema_names]
        if missing:
            raise LeRobotFormatError(
                f"{path}: episode table lacks columns {missing} (video keys come from "
                f"{root / INFO_PATH})"
            )
        cols = pq.read_table(path, columns=needed).to_pydict()
        for i, ep in enumerate(cols["episode_index"]):
            data_path = root / info["data_path"].format(
                chunk_index=cols["data/chunk_index"][i], file_index=cols["data/file_index"][i]
            )
            videos = {}
            for key in video_keys:
                vpath = root / info["video_path"].format(
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
