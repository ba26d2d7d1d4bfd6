"""LeRobot on-disk layout: path templates, codebase versions, default features, errors.

The constants mirror what LeRobot itself writes (``lerobot.datasets.utils`` at v2.1 and v3.0),
so datasets written here load in LeRobot and datasets written by LeRobot load here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longboat.core.errors import UserError

V21 = "v2.1"
V30 = "v3.0"
SUPPORTED_VERSIONS = (V21, V30)

INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
MODALITY_PATH = "meta/modality.json"  # GR00T's joint-group description

# v2.1: one parquet and one mp4 per episode, jsonl metadata.
V21_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V21_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
V21_EPISODES_PATH = "meta/episodes.jsonl"
V21_TASKS_PATH = "meta/tasks.jsonl"
V21_EPISODES_STATS_PATH = "meta/episodes_stats.jsonl"

# v3.0: many episodes per file, parquet metadata.
V30_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V30_EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_TASKS_PATH = "meta/tasks.parquet"

DEFAULT_CHUNK_SIZE = 1000
DEFAULT_DATA_FILE_SIZE_IN_MB = 100
DEFAULT_VIDEO_FILE_SIZE_IN_MB = 500

# Columns every LeRobot dataset carries, in LeRobot's order (appended after user features).
DEFAULT_FEATURES: dict[str, dict[str, Any]] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}

# Quantiles LeRobot (>=0.4) and GR00T store next to min/max/mean/std.
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}


class LeRobotFormatError(UserError, ValueError):
    """A LeRobot dataset on disk is malformed; the message names the file and episode (the
    command line prints it and exits 2)."""


class VideoDecodeError(UserError, RuntimeError):
    """A frame could not be decoded; the message names the video file, episode and timestamp
    (the command line prints it and exits 2)."""


def read_json(path: Path) -> Any:
    """Load a JSON file, naming the file when it is missing or unparsable."""
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: file not found (is the dataset root correct?)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LeRobotFormatError(f"{path}: invalid JSON ({exc})") from exc


def _parquet_error(path: Path, where: str, exc: Exception) -> LeRobotFormatError:
    return LeRobotFormatError(
        f"{path}: unreadable parquet ({where}): {str(exc).strip().splitlines()[0]}; the file "
        "is truncated or corrupt: copy or export it again"
    )


def read_parquet_schema(path: Path, where: str) -> Any:
    """``pyarrow.parquet.read_schema``; a truncated or corrupt file raises
    ``LeRobotFormatError`` naming it and ``where`` (e.g. ``"episode 3"``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise _parquet_error(path, where, exc) from exc


def read_parquet(path: Path, where: str, columns: list[str] | None = None) -> Any:
    """``pyarrow.parquet.read_table`` (all columns or ``columns``); a truncated or corrupt file
    (bad footer, page header, compressed page) raises ``LeRobotFormatError`` naming it and
    ``where``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise _parquet_error(path, where, exc) from exc


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Load a JSON-lines file (one object per non-empty line)."""
    if not path.is_file():
        raise LeRobotFormatError(f"{path}: file not found (is the dataset root correct?)")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise LeRobotFormatError(f"{path}:{lineno}: invalid JSON line ({exc})") from exc
    return rows


def write_json(data: Any, path: Path) -> None:
    """Write JSON the way LeRobot does (indent 4, unicode kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=4, ensure_ascii=False))


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    """Write JSON lines (one compact object per line, as LeRobot's jsonlines writer does)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def codebase_version(info: dict[str, Any], info_path: Path) -> str:
    """Return the dataset's codebase version or fail naming info.json and the supported ones."""
    version = info.get("codebase_version")
    if version not in SUPPORTED_VERSIONS:
        raise LeRobotFormatError(
            f"{info_path}: unknown codebase_version {version!r}; supported: "
            f"{', '.join(SUPPORTED_VERSIONS)} (convert older datasets with LeRobot's converters)"
        )
    return version
