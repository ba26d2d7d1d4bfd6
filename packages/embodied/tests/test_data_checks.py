"""Malformed LeRobot files through the real reader: every one is a ``LeRobotFormatError`` (a
core ``UserError``, exit 2) naming the file and episode; values far outside stats.json fail
naming file, episode, frame and feature (or are skipped and counted); the ``verify`` scan
lists every problem of a dataset at once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longboat.core.errors import UserError
from longboat.embodied.data import (
    LeRobotDataset,
    LeRobotFormatError,
    LeRobotMetadata,
    VideoDecodeError,
    write_synthetic_dataset,
)
from longboat.embodied.data.range_check import far_outside_stats
from longboat.embodied.data.synthetic import synthetic_frame, synthetic_state
from longboat.embodied.data.verify import verify_dataset
from longboat.embodied.data.video_encode import encode_mp4

LENGTH = 8


def make(root: Path, layout: str = "v2.1") -> Path:
    (out,) = write_synthetic_dataset(
        root, layout=layout, num_episodes=3, episode_length=(LENGTH, LENGTH), cameras=("front",)
    )
    return out


def v21_data(root: Path, ep: int) -> Path:
    return root / f"data/chunk-000/episode_{ep:06d}.parquet"


def v21_video(root: Path, ep: int) -> Path:
    return root / f"videos/chunk-000/observation.images.front/episode_{ep:06d}.mp4"


def test_format_errors_are_user_errors_exiting_2() -> None:
    assert issubclass(LeRobotFormatError, UserError) and LeRobotFormatError.exit_code == 2
    assert issubclass(VideoDecodeError, UserError) and VideoDecodeError.exit_code == 2


@pytest.mark.parametrize("layout", ["v2.1", "v3.0"])
def test_truncated_parquet_names_the_file_and_episode(tmp_path: Path, layout: str) -> None:
    root = make(tmp_path / "ds", layout)
    path = v21_data(root, 1) if layout == "v2.1" else root / "data/chunk-000/file-000.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    episode = "episode 1" if layout == "v2.1" else "episode 0, 1, 2"
    with pytest.raises(LeRobotFormatError) as err:
        LeRobotDataset(root)
    text = str(err.value)
    assert text.startswith(f"{path}: unreadable parquet ({episode}): ") and "truncated" in text


def test_truncated_metadata_parquet_names_the_file(tmp_path: Path) -> None:
    root = make(tmp_path / "ds", "v3.0")
    for name in ("meta/tasks.parquet", "meta/episodes/chunk-000/file-000.parquet"):
        path = root / name
        good = path.read_bytes()
        path.write_bytes(good[:-20])
        with pytest.raises(LeRobotFormatError, match=re.escape(f"{path}: unreadable parquet")):
            LeRobotMetadata.load(root)
        path.write_bytes(good)


def test_bytes_overwritten_in_the_middle_of_a_parquet(tmp_path: Path) -> None:
    root = make(tmp_path / "ds")
    path = v21_data(root, 2)
    data = bytearray(path.read_bytes())
    third = len(data) // 3
    data[third : 2 * third] = b"\xa5" * third
    path.write_bytes(bytes(data))
    with pytest.raises(LeRobotFormatError, match=re.escape(f"{path}: ") + r".*episode 2"):
        LeRobotDataset(root)


def _flip_to(path: Path, old: np.float32, new: np.float32) -> None:
    """Overwrite the bytes of one float32 in an uncompressed parquet file (as a disk or copy
    error would), leaving the file readable."""
    data = path.read_bytes()
    at = data.find(old.tobytes())
    assert at > 0 and data.count(old.tobytes()) == 1
    path.write_bytes(data[:at] + new.tobytes() + data[at + 4 :])


@pytest.fixture
def flipped(tmp_path: Path) -> Path:
    """v2.1 dataset whose episode 1, frame 5 has observation.state[2] = -1.18e29 on disk."""
    root = make(tmp_path / "ds")
    path = v21_data(root, 1)
    pq.write_table(pq.read_table(path), path, compression="none")
    _flip_to(path, synthetic_state(1, 5, 6)[2], np.float32(-1.18e29))
    assert pq.read_table(path).column("observation.state")[5][2].as_py() == pytest.approx(-1.18e29)
    return root


def test_values_far_outside_stats_fail_naming_file_episode_frame_and_feature(
    flipped: Path,
) -> None:
    with pytest.raises(LeRobotFormatError) as err:
        LeRobotDataset(flipped)
    text = str(err.value)
    assert text.startswith(
        f"{v21_data(flipped, 1)}: episode 1, frame 5: observation.state[2] = -1.18e+29 is far "
        "outside the dataset's range ["
    )
    assert "1 frame(s) like it" in text and "data.skip_bad_samples=true" in text


def test_skip_bad_samples_skips_and_counts_frames_with_bad_values(flipped: Path) -> None:
    ds = LeRobotDataset(flipped, skip_bad_samples=True)
    assert ds.bad_frames == 1
    start, _ = ds.episode_ranges[1]
    assert int(ds[start + 4]["frame_index"]) == 4 and ds.skipped == 0
    sample = ds[start + 5]  # the bad frame: the next one comes back
    assert (int(sample["episode_index"]), int(sample["frame_index"])) == (1, 6)
    assert ds.skipped == 1
    states = np.stack([ds[i]["observation.state"].numpy() for i in range(len(ds))])
    assert np.abs(states).max() < 2.0 and ds.skipped == 2  # the bad frame was skipped again
    # A sample whose action chunk reaches the bad frame reads it too: skipped as well.
    chunked = LeRobotDataset(
        flipped, skip_bad_samples=True, delta_timestamps={"action": [k / 10 for k in range(4)]}
    )
    sample = chunked[start + 2]  # frames 2..5 read frame 5
    assert int(sample["frame_index"]) == 6 and chunked.skipped == 4


def test_nan_and_unknown_task_index_are_bad_values(tmp_path: Path) -> None:
    root = make(tmp_path / "ds")
    path = v21_data(root, 0)
    pq.write_table(pq.read_table(path), path, compression="none")
    _flip_to(path, synthetic_state(0, 3, 6)[0], np.float32("nan"))
    with pytest.raises(
        LeRobotFormatError, match=r"episode 0, frame 3: observation.state\[0\] = nan"
    ):
        LeRobotDataset(root)
    root = make(tmp_path / "ds2")
    path = v21_data(root, 2)
    table = pq.read_table(path)
    tasks = table.column("task_index").to_pylist()
    tasks[6] = 7
    i = table.schema.get_field_index("task_index")
    pq.write_table(table.set_column(i, "task_index", pa.array(tasks, pa.int64())), path)
    with pytest.raises(
        LeRobotFormatError,
        match=re.escape(f"{path}: episode 2, frame 6: task_index = 7 is not among the "),
    ):
        LeRobotDataset(root)


def test_far_outside_is_ten_ranges_beyond_min_or_max() -> None:
    n = (1 << 18) + 3  # past one block of rows
    state = np.zeros((n, 2), np.float32)
    state[:, 1] = 0.5  # a constant dim: its own magnitude (at least 1) is the range
    state[10] = [1.0 + 20.0, 0.5]  # exactly 10 ranges above max: still fine
    state[11] = [-1.0 - 20.5, 0.5]  # beyond min - 10 ranges
    state[12] = [0.0, 0.5 + 10.0]  # constant dim: 10 x 1.0 above its max: fine
    state[13] = [0.0, 11.5]  # beyond
    state[n - 1] = [np.inf, 0.5]
    label = np.full(n, 7.0)  # no stats: not checked
    image = np.full((n, 4), 100.0)  # stats of another shape: not checked
    stats = {
        "state": {"min": np.array([-1.0, 0.5]), "max": np.array([1.0, 0.5])},
        "image": {"min": np.zeros((3, 1, 1, 1)), "max": np.ones((3, 1, 1, 1))},
    }
    cols = {"state": state, "label": label, "image": image}
    bad, found = far_outside_stats(cols, stats, ["state", "label", "image"])
    assert np.flatnonzero(bad).tolist() == [11, 13, n - 1]
    assert len(found) == 1
    v = found[0]
    assert (v.key, v.row, v.dim, v.value, v.low, v.high, v.rows) == (
        "state",
        11,
        0,
        -21.5,
        -1.0,
        1.0,
        3,
    )


def _edit_info(root: Path, edit) -> None:
    path = root / "meta/info.json"
    info = json.loads(path.read_text())
    edit(info)
    path.write_text(json.dumps(info))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: p.write_text('{"codebase_version": "v2.1", "fps": '), "invalid JSON"),
        (lambda p: p.write_bytes(b"\xff\xfe\x00garbage"), "invalid JSON"),
        (lambda p: p.write_text("[1, 2]"), "expected a JSON object, got list"),
        (
            lambda p: _edit_info(p.parents[1], lambda i: i.__setitem__("fps", "ten")),
            "'fps' must be a positive integer, got 'ten'",
        ),
        (
            lambda p: _edit_info(
                p.parents[1], lambda i: i["features"]["action"].__setitem__("shape", ["5"])
            ),
            "feature 'action' has shape ['5']; expected a list of positive integers",
        ),
        (
            lambda p: _edit_info(
                p.parents[1], lambda i: i.__setitem__("data_path", "data/{chunk}/{episode}.pq")
            ),
            "data_path template 'data/{chunk}/{episode}.pq' cannot be filled",
        ),
    ],
)
def test_bad_info_json_names_the_file(tmp_path: Path, edit, message: str) -> None:
    root = make(tmp_path / "ds")
    info = root / "meta/info.json"
    edit(info)
    with pytest.raises(LeRobotFormatError) as err:
        LeRobotDataset(root)
    assert str(err.value).startswith(f"{info}: ") and message in str(err.value)


def test_bad_episode_rows_and_stats_name_the_file(tmp_path: Path) -> None:
    root = make(tmp_path / "ds")
    episodes = root / "meta/episodes.jsonl"
    good = episodes.read_text()
    episodes.write_text(good.replace(', "length": 8', "", 1))
    with pytest.raises(LeRobotFormatError, match=re.escape(f"{episodes}: row 1 lacks ['length']")):
        LeRobotDataset(root)
    episodes.write_text(good)
    stats = root / "meta/stats.json"
    stats.write_text(json.dumps({"action": {"min": ["a", "b"]}}))
    with pytest.raises(LeRobotFormatError, match=re.escape(f"{stats}: stats are not numeric")):
        LeRobotDataset(root)


def test_corrupt_video_fails_naming_the_file_and_episode(tmp_path: Path) -> None:
    root = make(tmp_path / "ds")
    video = v21_video(root, 1)
    video.write_bytes(b"\x00garbage" * (video.stat().st_size // 8))
    ds = LeRobotDataset(root)  # the file exists: opened only when a frame is needed
    start, _ = ds.episode_ranges[1]
    with pytest.raises(VideoDecodeError, match=re.escape(str(video)) + r".*episode 1"):
        ds[start]
    assert int(LeRobotDataset(root, skip_bad_samples=True)[start]["episode_index"]) == 2


def test_verify_scans_every_file_and_lists_every_problem(tmp_path: Path) -> None:
    root = make(tmp_path / "ds")
    report = verify_dataset(LeRobotMetadata.load(root))
    assert (report.data_files, report.video_files, report.episodes, report.frames) == (3, 3, 3, 24)
    assert report.problems == [] and report.summary().endswith("s: no problems")
    report.raise_if_problems()  # nothing to raise

    truncated = v21_data(root, 0)
    truncated.write_bytes(truncated.read_bytes()[:-30])
    garbage = v21_video(root, 1)
    garbage.write_bytes(b"\x00garbage" * 100)
    short = v21_video(root, 2)
    encode_mp4(short, [synthetic_frame(2, list(range(5)), 0, 24, 32)], 10)  # 5 of 8 frames
    fast = v21_video(root, 0)
    encode_mp4(fast, [synthetic_frame(0, list(range(8)), 0, 24, 32)], 20)  # 8 frames in 0.4s
    report = verify_dataset(LeRobotMetadata.load(root))
    assert len(report.problems) == 4
    first, second, third, fourth = report.problems
    assert first.startswith(f"{truncated}: unreadable parquet (episode 0)")
    assert second == (
        f"{fast}: episode 0 (observation.images.front) needs frames up to 0.700000s but the "
        "video ends at 0.350000s (timestamps beyond the video)"
    )
    assert third.startswith(f"{garbage}: video cannot be opened or decoded (episode 1, camera")
    assert fourth == (
        f"{short}: video holds 5 frames but episode 2 need 8 (camera observation.images.front; "
        "truncated?)"
    )
    with pytest.raises(LeRobotFormatError) as err:
        report.raise_if_problems()
    lines = str(err.value).splitlines()
    assert lines[0].startswith("data.verify: 3 data file(s), 3 video file(s), 3 episode(s)")
    assert lines[0].endswith("4 problem(s):") and lines[1:] == [f"  - {p}" for p in report.problems]
