"""Corrupt datasets fail with the file and episode named; bad decodes can be skipped and counted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longboat.embodied.data import (
    LeRobotDataset,
    LeRobotFormatError,
    VideoDecodeError,
    write_synthetic_dataset,
)
from longboat.embodied.data.synthetic import synthetic_frame
from longboat.embodied.data.video_encode import encode_mp4


def make(tmp_path: Path, layout: str, per_file: int | None = None) -> Path:
    (root,) = write_synthetic_dataset(
        tmp_path / layout,
        layout=layout,
        num_episodes=3,
        episode_length=(8, 8),
        cameras=("front",),
        episodes_per_file=per_file,
    )
    return root


def edit_info(root: Path, fn) -> None:
    path = root / "meta/info.json"
    info = json.loads(path.read_text())
    fn(info)
    path.write_text(json.dumps(info))


@pytest.mark.parametrize("layout", ["v2.1", "v3.0"])
def test_missing_video_names_file_and_episode(tmp_path, layout):
    root = make(tmp_path, layout, per_file=2 if layout == "v3.0" else None)
    victim = sorted((root / "videos").rglob("*.mp4"))[-1]  # holds episode 2 only
    victim.unlink()
    with pytest.raises(LeRobotFormatError, match=re.escape(str(victim)) + r".*episode 2"):
        LeRobotDataset(root)
    ds = LeRobotDataset(root, skip_bad_samples=True)
    start, end = ds.episode_ranges[2]
    s = ds[start]  # episode 2 cannot decode: falls through to the next sample
    assert int(s["episode_index"]) == 0  # wrapped around to the first sample
    assert ds.skipped == end - start  # all of episode 2's frames were tried and skipped
    assert int(ds[0]["episode_index"]) == 0 and ds.skipped == end - start


def test_truncated_video_fails_then_is_skipped(tmp_path):
    root = make(tmp_path, "v2.1")
    path = root / "videos/chunk-000/observation.images.front/episode_000001.mp4"
    encode_mp4(path, [synthetic_frame(1, list(range(5)), 0, 24, 32)], 10)  # 5 of 8 frames
    ds = LeRobotDataset(root)
    start, _ = ds.episode_ranges[1]
    ds[start + 4]  # frames that exist still decode
    with pytest.raises(
        VideoDecodeError,
        match=r"episode 1, camera observation.images.front: .*episode_000001.mp4: no frame at 0.600000s",
    ):
        ds[start + 6]
    skipping = LeRobotDataset(root, skip_bad_samples=True)
    s = skipping[start + 6]
    assert int(s["episode_index"]) == 2 and skipping.skipped == 2  # frames 6 and 7 skipped


def test_timestamps_beyond_episode(tmp_path):
    root = make(tmp_path, "v3.0")
    path = root / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    col = "videos/observation.images.front/to_timestamp"
    ends = table.column(col).to_pylist()
    ends[1] -= 0.35  # the video span of episode 1 now ends before its last frames
    table = table.set_column(table.schema.get_field_index(col), col, pa.array(ends))
    pq.write_table(table, path)
    with pytest.raises(LeRobotFormatError, match=r"file-000.mp4: episode 1 needs frames up to 1.5"):
        LeRobotDataset(root)

    root2 = make(tmp_path / "b", "v2.1")
    data = root2 / "data/chunk-000/episode_000002.parquet"
    t = pq.read_table(data)
    ts = t.column("timestamp").to_pylist()
    ts[-1] = 3.0
    t = t.set_column(
        t.schema.get_field_index("timestamp"),
        t.schema.field("timestamp"),
        pa.array(ts, pa.float32()),
    )
    pq.write_table(t, data)
    with pytest.raises(
        LeRobotFormatError,
        match=r"episode_000002.parquet: episode 2 frame 7 has timestamp 3.000000s",
    ):
        LeRobotDataset(root2)


@pytest.mark.parametrize("layout", ["v2.1", "v3.0"])
def test_feature_missing_from_info(tmp_path, layout):
    root = make(tmp_path, layout)
    edit_info(root, lambda info: info["features"].pop("observation.state"))
    with pytest.raises(
        LeRobotFormatError,
        match=r"\.parquet: columns \['observation.state'\] are missing from .*info.json features \(episode 0",
    ):
        LeRobotDataset(root)
    root2 = make(tmp_path / "b", layout)
    with pytest.raises(
        LeRobotFormatError, match=r"delta_timestamps key 'actions' is missing from info.json"
    ):
        LeRobotDataset(root2, delta_timestamps={"actions": [0.0]})
    with pytest.raises(
        LeRobotFormatError, match=r"camera 'observation.images.top' is not a video or image feature"
    ):
        LeRobotDataset(root2, camera_keys=["observation.images.top"])


def test_column_declared_but_absent(tmp_path):
    root = make(tmp_path, "v2.1")
    edit_info(
        root,
        lambda info: info["features"].__setitem__(
            "observation.effort", {"dtype": "float32", "shape": [2], "names": None}
        ),
    )
    with pytest.raises(
        LeRobotFormatError,
        match=r"episode_000000.parquet: columns \['observation.effort'\] declared in .*info.json are missing \(episode 0\)",
    ):
        LeRobotDataset(root)


def test_unknown_codebase_version(tmp_path):
    root = make(tmp_path, "v3.0")
    edit_info(root, lambda info: info.__setitem__("codebase_version", "v2.0"))
    with pytest.raises(
        LeRobotFormatError,
        match=r"info.json: unknown codebase_version 'v2.0'; supported: v2.1, v3.0",
    ):
        LeRobotDataset(root)


def test_bad_delta_timestamps(tmp_path):
    root = make(tmp_path, "v3.0")
    with pytest.raises(ValueError, match=r"delta_timestamps\['action'\].*0.05.*multiples of 1/10s"):
        LeRobotDataset(root, delta_timestamps={"action": [0.0, 0.05]})
