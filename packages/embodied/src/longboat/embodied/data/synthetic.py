"""Synthetic LeRobot datasets (v2.1 and v3.0) whose every value is a known function.

State, action and camera frames are closed-form functions of (episode, frame, camera), exposed
as :func:`synthetic_state`, :func:`synthetic_action` and :func:`synthetic_frame`, so a reader
can be checked exactly (parquet values) or within codec tolerance (video frames).

Each embodiment is its own LeRobot dataset (LeRobot features have one fixed shape per
dataset): with one embodiment the dataset is written at ``root``, with several at
``root/<embodiment name>``. Every dataset carries an ``embodiment_id`` int64 column.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from longboat.embodied.data.layout import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DATA_FILE_SIZE_IN_MB,
    DEFAULT_FEATURES,
    DEFAULT_VIDEO_FILE_SIZE_IN_MB,
    MODALITY_PATH,
    STATS_PATH,
    V21,
    V21_DATA_PATH,
    V21_EPISODES_PATH,
    V21_EPISODES_STATS_PATH,
    V21_TASKS_PATH,
    V21_VIDEO_PATH,
    V30,
    V30_DATA_PATH,
    V30_EPISODES_PATH,
    V30_TASKS_PATH,
    V30_VIDEO_PATH,
    write_json,
    write_jsonl,
)
from longboat.embodied.data.stats import feature_stats, image_stats, stats_to_json
from longboat.embodied.data.video_encode import encode_mp4

STATE_KEY = "observation.state"
ACTION_KEY = "action"
EMBODIMENT_KEY = "embodiment_id"


@dataclass(frozen=True, kw_only=True)
class EmbodimentSpec:
    """One robot: its state/action sizes and GR00T joint groups (name -> number of dims)."""

    name: str
    """Embodiment name; also the sub-directory when several embodiments are written."""
    state_dim: int
    """Size of ``observation.state``."""
    action_dim: int
    """Size of ``action``."""
    state_groups: dict[str, int] = field(default_factory=dict)
    """modality.json state groups in order; empty -> ``arm`` (all but last) + ``gripper``."""
    action_groups: dict[str, int] = field(default_factory=dict)
    """modality.json action groups in order; empty -> ``arm`` + ``gripper`` like the state."""


def _default_groups(dim: int, groups: dict[str, int], what: str, name: str) -> dict[str, int]:
    if not groups:
        return {"arm": dim - 1, "gripper": 1} if dim > 1 else {"arm": dim}
    if sum(groups.values()) != dim:
        raise ValueError(
            f"embodiment {name!r}: {what}_groups sizes {groups} sum to {sum(groups.values())}, "
            f"but {what}_dim is {dim}; make them add up"
        )
    return dict(groups)


def synthetic_state(
    episode: int, frame_index: np.ndarray | int, dim: int, embodiment: int = 0
) -> np.ndarray:
    """State of ``episode`` at ``frame_index`` (scalar -> [dim], array [T] -> [T,dim]), float32."""
    t = np.asarray(frame_index, dtype=np.float64)[..., None]
    d = np.arange(dim, dtype=np.float64)
    val = np.sin(0.25 * t + 0.5 * d + 0.9 * episode + 0.3 * embodiment) * (1.0 + 0.1 * d)
    return val.astype(np.float32)


def synthetic_action(
    episode: int, frame_index: np.ndarray | int, dim: int, embodiment: int = 0
) -> np.ndarray:
    """Action of ``episode`` at ``frame_index`` (same broadcasting as the state), float32."""
    t = np.asarray(frame_index, dtype=np.float64)[..., None]
    d = np.arange(dim, dtype=np.float64)
    val = np.cos(0.2 * t - 0.4 * d + 1.3 * episode) * 2.0 + 0.05 * d + 0.1 * embodiment
    return val.astype(np.float32)


def synthetic_frame(
    episode: int, frame_index: np.ndarray | int, camera: int, height: int, width: int
) -> np.ndarray:
    """uint8 RGB frame(s) [H,W,3] (or [T,H,W,3]): smooth gradients whose levels move per frame.

    Red and blue step by 9 and 5 levels per frame with different periods (160, 150), so any
    two frames of an episode differ by far more than h264's error on these smooth images.
    """
    t = np.atleast_1d(np.asarray(frame_index, dtype=np.int64))
    y = np.arange(height, dtype=np.float64)[None, :, None] / height
    x = np.arange(width, dtype=np.float64)[None, None, :] / width
    red_level = (40 + (9 * t + 31 * episode + 57 * camera) % 160).astype(np.float64)
    blue_level = (50 + (5 * t + 17 * episode + 23 * camera) % 150).astype(np.float64)
    red = red_level[:, None, None] + 30.0 * x + 10.0 * y
    green = 128.0 + 40.0 * np.sin(2 * math.pi * x + 0.4 * t[:, None, None]) + 20.0 * y
    blue = blue_level[:, None, None] + 25.0 * y + 0.0 * x
    frames = np.stack(np.broadcast_arrays(red, green, blue), axis=-1)
    frames = np.clip(np.rint(frames), 0, 255).astype(np.uint8)
    return frames[0] if np.ndim(frame_index) == 0 else frames


def _hf_features_metadata(features: dict[str, dict[str, Any]], layout: str) -> bytes:
    """The ``huggingface`` schema metadata HF ``datasets`` embeds in parquet files it writes."""
    # datasets 3.x (LeRobot v2.1 era) names fixed-length lists "Sequence", datasets 4.x "List".
    list_type = "Sequence" if layout == V21 else "List"
    hf: dict[str, Any] = {}
    for key, ft in features.items():
        if ft["dtype"] in ("video", "image"):
            continue
        value = {"dtype": ft["dtype"], "_type": "Value"}
        if list(ft["shape"]) == [1]:
            hf[key] = value
        else:
            hf[key] = {"feature": value, "length": int(ft["shape"][0]), "_type": list_type}
    return json.dumps({"info": {"features": hf}}).encode()


def _data_table(
    columns: dict[str, np.ndarray], features: dict[str, dict[str, Any]], layout: str
) -> pa.Table:
    """Frame table with LeRobot's arrow types: scalars as values, vectors as fixed-size lists."""
    arrays, fields = [], []
    for key, ft in features.items():
        if ft["dtype"] in ("video", "image"):
            continue
        col = np.asarray(columns[key])
        value_type = pa.from_numpy_dtype(np.dtype(ft["dtype"]))
        if list(ft["shape"]) == [1]:
            arr = pa.array(col.reshape(-1).astype(ft["dtype"]), type=value_type)
        else:
            flat = pa.array(col.reshape(-1).astype(ft["dtype"]), type=value_type)
            arr = pa.FixedSizeListArray.from_arrays(flat, int(ft["shape"][0]))
        arrays.append(arr)
        fields.append(pa.field(key, arr.type))
    schema = pa.schema(fields, metadata={"huggingface": _hf_features_metadata(features, layout)})
    return pa.Table.from_arrays(arrays, schema=schema)


def _tasks_table(tasks: list[str]) -> pa.Table:
    """``meta/tasks.parquet`` as LeRobot writes it: a pandas frame indexed by ``task``."""
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [
            {
                "name": None,
                "field_name": None,
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": {"encoding": "UTF-8"},
            }
        ],
        "columns": [
            {
                "name": "task_index",
                "field_name": "task_index",
                "pandas_type": "int64",
                "numpy_type": "int64",
                "metadata": None,
            },
            {
                "name": "task",
                "field_name": "task",
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": None,
            },
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.3",
    }
    schema = pa.schema(
        [pa.field("task_index", pa.int64()), pa.field("task", pa.string())],
        metadata={"pandas": json.dumps(pandas_meta).encode()},
    )
    return pa.Table.from_arrays(
        [pa.array(range(len(tasks)), pa.int64()), pa.array(tasks, pa.string())], schema=schema
    )


@dataclass
class _Episode:
    index: int
    length: int
    task: str
    task_index: int
    columns: dict[str, np.ndarray]
    frames: dict[str, np.ndarray]  # video key -> uint8 [T,H,W,3]
    stats: dict[str, dict[str, np.ndarray]]


def _features(
    spec: EmbodimentSpec,
    video_keys: list[str],
    sizes: dict[str, tuple[int, int]],
    fps: int,
    layout: str,
    gop: int,
    crf: int,
) -> dict[str, dict[str, Any]]:
    feats: dict[str, dict[str, Any]] = {
        STATE_KEY: {
            "dtype": "float32",
            "shape": [spec.state_dim],
            "names": [f"joint_{i}" for i in range(spec.state_dim)],
        },
        ACTION_KEY: {
            "dtype": "float32",
            "shape": [spec.action_dim],
            "names": [f"action_{i}" for i in range(spec.action_dim)],
        },
    }
    for key in video_keys:
        height, width = sizes[key]
        info: dict[str, Any] = {
            "video.height": height,
            "video.width": width,
            "video.codec": "h264",
            "video.pix_fmt": "yuv420p",
            "video.fps": fps,
            "video.channels": 3,
            "has_audio": False,
        }
        if layout == V21:
            info["video.is_depth_map"] = False
        else:
            # LeRobot >= 0.5 records the encoder settings and the canonical depth flag.
            info.update({"video.g": gop, "video.crf": crf, "video.video_backend": "pyav"})
            info["is_depth_map"] = False
        feats[key] = {
            "dtype": "video",
            "shape": [height, width, 3],
            "names": ["height", "width", "channels"],
            "info": info,
        }
    feats[EMBODIMENT_KEY] = {"dtype": "int64", "shape": [1], "names": None}
    feats.update({k: dict(v) for k, v in DEFAULT_FEATURES.items()})
    return feats


def _modality(spec: EmbodimentSpec, video_keys: list[str]) -> dict[str, Any]:
    def groups(sizes: dict[str, int], key: str) -> dict[str, Any]:
        out, start = {}, 0
        for name, size in sizes.items():
            out[name] = {"start": start, "end": start + size, "original_key": key}
            start += size
        return out

    return {
        "state": groups(
            _default_groups(spec.state_dim, spec.state_groups, "state", spec.name), STATE_KEY
        ),
        "action": groups(
            _default_groups(spec.action_dim, spec.action_groups, "action", spec.name), ACTION_KEY
        ),
        "video": {k.rsplit(".", 1)[-1]: {"original_key": k} for k in video_keys},
        "annotation": {"human.task_description": {"original_key": "task_index"}},
    }


IMAGE_KEY_PREFIX = "observation.images."
"""LeRobot's prefix of camera feature keys."""


def camera_key(name: str) -> str:
    """The feature key of a camera named ``name``: ``top`` -> ``observation.images.top``; a
    full key (``observation.images.top``) as it is."""
    return name if name.startswith(IMAGE_KEY_PREFIX) else IMAGE_KEY_PREFIX + name


def write_synthetic_dataset(
    root: str | Path,
    *,
    layout: Literal["v2.1", "v3.0"] = V30,
    num_episodes: int = 3,
    episode_length: tuple[int, int] = (20, 20),
    fps: int = 10,
    cameras: tuple[str, ...] = ("front", "wrist"),
    image_size: tuple[int, int] = (24, 32),
    camera_sizes: Mapping[str, tuple[int, int]] | None = None,
    embodiments: tuple[EmbodimentSpec, ...] = (
        EmbodimentSpec(name="arm6", state_dim=6, action_dim=5),
    ),
    tasks: tuple[str, ...] = ("pick up the red cube", "place the cube in the bowl"),
    seed: int = 0,
    crf: int = 12,
    gop: int = 8,
    episodes_per_file: int | None = None,
    robot_type: str | None = None,
    embodiment_ids: tuple[int, ...] | None = None,
    image_stats_stride: tuple[int, int, int] = (1, 1, 1),
) -> list[Path]:
    """Write one synthetic LeRobot dataset per embodiment; return their roots.

    ``episode_length`` is an inclusive (min, max) range drawn per episode from ``seed``;
    ``cameras`` are names (``top``) or full keys (``observation.images.top``), both giving the
    key ``observation.images.top`` (``camera_key``); ``image_size`` is (height, width), both
    even, of every camera not in ``camera_sizes`` (camera name or key -> (height, width)); ``episodes_per_file`` (v3.0 only) splits data and
    videos into several files (default: all episodes in file-000).

    ``embodiment_ids`` gives each embodiment its id (the ``embodiment_id`` column and the
    ``embodiment`` argument of the known-value functions; default: its position in
    ``embodiments``), so datasets written one call at a time can share one id space.
    ``image_stats_stride`` = (frames, rows, columns) computes the camera statistics on every
    n-th frame, row and column: exact quantiles read every pixel, which costs more than the
    encode on large datasets whose statistics nothing reads; (1, 1, 1) reads every pixel.
    """
    if layout not in (V21, V30):
        raise ValueError(f"layout={layout!r} is not supported; use 'v2.1' or 'v3.0'")
    lo, hi = episode_length
    if not 1 <= lo <= hi:
        raise ValueError(f"episode_length={episode_length} must be (min, max) with 1 <= min <= max")
    if num_episodes < 1 or not tasks or not embodiments:
        raise ValueError("num_episodes, tasks and embodiments must all be non-empty")
    if episodes_per_file is not None and layout != V30:
        raise ValueError("episodes_per_file applies to layout='v3.0' only; drop it for v2.1")
    ids = tuple(range(len(embodiments))) if embodiment_ids is None else tuple(embodiment_ids)
    if len(ids) != len(embodiments) or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(
            f"embodiment_ids={embodiment_ids} must give each of the {len(embodiments)} "
            "embodiments its own id >= 0"
        )
    if len(image_stats_stride) != 3 or min(image_stats_stride) < 1:
        raise ValueError(
            f"image_stats_stride={image_stats_stride} must be 3 strides >= 1 (frames, rows, "
            "columns)"
        )
    keys = [camera_key(cam) for cam in cameras]
    if len(set(keys)) != len(keys):
        raise ValueError(f"cameras={cameras} names a camera twice (as keys: {keys})")
    given_sizes = {camera_key(cam): hw for cam, hw in (camera_sizes or {}).items()}
    unknown = sorted(set(given_sizes) - set(keys))
    if unknown:
        raise ValueError(f"camera_sizes names cameras {unknown} not in cameras={cameras}")
    sizes = {key: tuple(given_sizes.get(key, image_size)) for key in keys}
    root = Path(root)
    roots = []
    for position, (emb_id, spec) in enumerate(zip(ids, embodiments, strict=True)):
        ds_root = root if len(embodiments) == 1 else root / spec.name
        rng = np.random.default_rng([seed, position])
        _write_one(
            ds_root,
            layout=layout,
            spec=spec,
            emb_id=emb_id,
            stats_stride=tuple(image_stats_stride),
            lengths=rng.integers(lo, hi + 1, size=num_episodes).tolist(),
            task_picks=rng.integers(0, len(tasks), size=num_episodes).tolist(),
            tasks=list(tasks),
            fps=fps,
            cameras=tuple(keys),
            sizes=sizes,
            crf=crf,
            gop=gop,
            episodes_per_file=episodes_per_file or num_episodes,
            robot_type=robot_type or spec.name,
        )
        roots.append(ds_root)
    return roots


def _write_one(
    root: Path,
    *,
    layout: str,
    spec: EmbodimentSpec,
    emb_id: int,
    stats_stride: tuple[int, ...],
    lengths: list[int],
    task_picks: list[int],
    tasks: list[str],
    fps: int,
    cameras: tuple[str, ...],
    sizes: dict[str, tuple[int, int]],
    crf: int,
    gop: int,
    episodes_per_file: int,
    robot_type: str,
) -> None:
    video_keys = list(cameras)  # full keys (camera_key)
    f_step, r_step, c_step = stats_stride

    def frame_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
        return image_stats(frames[::f_step, ::r_step, ::c_step])

    key_sizes = dict(sizes)
    features = _features(spec, video_keys, key_sizes, fps, layout, gop, crf)
    # Task indices follow first appearance, as LeRobot assigns them while recording.
    used_tasks: list[str] = []
    episodes: list[_Episode] = []
    offset = 0
    for ep, (length, pick) in enumerate(zip(lengths, task_picks, strict=True)):
        task = tasks[pick]
        if task not in used_tasks:
            used_tasks.append(task)
        t = np.arange(length)
        cols = {
            ACTION_KEY: synthetic_action(ep, t, spec.action_dim, emb_id),
            STATE_KEY: synthetic_state(ep, t, spec.state_dim, emb_id),
            EMBODIMENT_KEY: np.full(length, emb_id, np.int64),
            "timestamp": (t / fps).astype(np.float32),
            "frame_index": t.astype(np.int64),
            "episode_index": np.full(length, ep, np.int64),
            "index": np.arange(offset, offset + length, dtype=np.int64),
            "task_index": np.full(length, used_tasks.index(task), np.int64),
        }
        frames = {
            key: synthetic_frame(ep, t, cam, *key_sizes[key]) for cam, key in enumerate(video_keys)
        }
        stats = {}
        for key in features:
            if key in frames:
                stats[key] = frame_stats(frames[key])
            else:
                stats[key] = feature_stats(cols[key])
        episodes.append(_Episode(ep, length, task, used_tasks.index(task), cols, frames, stats))
        offset += length

    all_stats = {}
    for key in features:
        if key in video_keys:
            all_stats[key] = frame_stats(np.concatenate([e.frames[key] for e in episodes]))
        else:
            all_stats[key] = feature_stats(np.concatenate([e.columns[key] for e in episodes]))
    write_json(stats_to_json(all_stats), root / STATS_PATH)
    write_json(_modality(spec, video_keys), root / MODALITY_PATH)

    total_frames = sum(lengths)
    n = len(episodes)
    common = {
        "codebase_version": layout,
        "robot_type": robot_type,
        "total_episodes": n,
        "total_frames": total_frames,
        "total_tasks": len(used_tasks),
    }
    if layout == V21:
        info = {
            **common,
            "total_videos": n * len(video_keys),
            "total_chunks": math.ceil(n / DEFAULT_CHUNK_SIZE),
            "chunks_size": DEFAULT_CHUNK_SIZE,
            "fps": fps,
            "splits": {"train": f"0:{n}"},
            "data_path": V21_DATA_PATH,
            "video_path": V21_VIDEO_PATH if video_keys else None,
            "features": features,
        }
        _write_v21(root, episodes, used_tasks, features, video_keys, fps, crf, gop)
    else:
        info = {
            **common,
            "chunks_size": DEFAULT_CHUNK_SIZE,
            "data_files_size_in_mb": DEFAULT_DATA_FILE_SIZE_IN_MB,
            "video_files_size_in_mb": DEFAULT_VIDEO_FILE_SIZE_IN_MB,
            "fps": fps,
            "splits": {"train": f"0:{n}"},
            "data_path": V30_DATA_PATH,
            "video_path": V30_VIDEO_PATH if video_keys else None,
            "features": features,
        }
        _write_v30(
            root, episodes, used_tasks, features, video_keys, fps, crf, gop, episodes_per_file
        )
    write_json(info, root / "meta/info.json")


def _write_v21(
    root: Path,
    episodes: list[_Episode],
    tasks: list[str],
    features: dict[str, dict[str, Any]],
    video_keys: list[str],
    fps: int,
    crf: int,
    gop: int,
) -> None:
    for ep in episodes:
        chunk = ep.index // DEFAULT_CHUNK_SIZE
        path = root / V21_DATA_PATH.format(episode_chunk=chunk, episode_index=ep.index)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_data_table(ep.columns, features, V21), path)
        for key in video_keys:
            vpath = root / V21_VIDEO_PATH.format(
                episode_chunk=chunk, video_key=key, episode_index=ep.index
            )
            encode_mp4(vpath, [ep.frames[key]], fps, crf=crf, gop=gop)
    write_jsonl(
        [{"episode_index": e.index, "tasks": [e.task], "length": e.length} for e in episodes],
        root / V21_EPISODES_PATH,
    )
    write_jsonl(
        [{"task_index": i, "task": task} for i, task in enumerate(tasks)], root / V21_TASKS_PATH
    )
    write_jsonl(
        [{"episode_index": e.index, "stats": stats_to_json(e.stats)} for e in episodes],
        root / V21_EPISODES_STATS_PATH,
    )


def _write_v30(
    root: Path,
    episodes: list[_Episode],
    tasks: list[str],
    features: dict[str, dict[str, Any]],
    video_keys: list[str],
    fps: int,
    crf: int,
    gop: int,
    episodes_per_file: int,
) -> None:
    rows: dict[str, list[Any]] = {}

    def add(key: str, value: Any) -> None:
        rows.setdefault(key, []).append(value)

    groups = [
        episodes[i : i + episodes_per_file] for i in range(0, len(episodes), episodes_per_file)
    ]
    for file_no, group in enumerate(groups):
        chunk_idx, file_idx = divmod(file_no, DEFAULT_CHUNK_SIZE)
        cols = {
            key: np.concatenate([e.columns[key] for e in group])
            for key, ft in features.items()
            if ft["dtype"] != "video"
        }
        path = root / V30_DATA_PATH.format(chunk_index=chunk_idx, file_index=file_idx)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_data_table(cols, features, V30), path, compression="snappy")
        for key in video_keys:
            vpath = root / V30_VIDEO_PATH.format(
                video_key=key, chunk_index=chunk_idx, file_index=file_idx
            )
            encode_mp4(vpath, [e.frames[key] for e in group], fps, crf=crf, gop=gop)
        video_start = 0.0
        for ep in group:
            add("episode_index", ep.index)
            add("tasks", [ep.task])
            add("length", ep.length)
            add("data/chunk_index", chunk_idx)
            add("data/file_index", file_idx)
            add("dataset_from_index", int(ep.columns["index"][0]))
            add("dataset_to_index", int(ep.columns["index"][-1]) + 1)
            duration = ep.length / fps
            for key in video_keys:
                add(f"videos/{key}/chunk_index", chunk_idx)
                add(f"videos/{key}/file_index", file_idx)
                add(f"videos/{key}/from_timestamp", video_start)
                add(f"videos/{key}/to_timestamp", video_start + duration)
            video_start += duration
            for key, st in ep.stats.items():
                for name, value in st.items():
                    add(f"stats/{key}/{name}", np.asarray(value).tolist())
            add("meta/episodes/chunk_index", 0)
            add("meta/episodes/file_index", 0)
    meta_path = root / V30_EPISODES_PATH.format(chunk_index=0, file_index=0)
    meta_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pydict(rows), meta_path, compression="snappy")
    pq.write_table(_tasks_table(tasks), root / V30_TASKS_PATH)
