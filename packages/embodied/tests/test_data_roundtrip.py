"""Synthetic writer -> LeRobotDataset round trip for LeRobot v2.1 and v3.0.

Parquet values must come back bit-exact. Video frames go through h264 yuv420p (crf 12) on
smooth 32x24 images; the stated codec tolerance is: mean |error| <= 3 levels and max |error|
<= 16 levels per frame (measured: ~2 and ~9), and the decoded frame must be closer to the
frame written at that index than to any other frame of its episode.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from longboat.embodied.data import (
    EmbodimentSpec,
    LeRobotDataset,
    synthetic_action,
    synthetic_frame,
    synthetic_state,
    write_synthetic_dataset,
)

FPS = 10
H, W = 24, 32
MEAN_TOL, MAX_TOL = 3.0, 16
LAYOUTS = [("v2.1", None), ("v3.0", None), ("v3.0", 2)]  # (layout, episodes_per_file)


@pytest.fixture(scope="module", params=LAYOUTS, ids=["v2.1", "v3.0", "v3.0-multifile"])
def dataset_root(request, tmp_path_factory):
    layout, per_file = request.param
    root = tmp_path_factory.mktemp(f"ds_{layout}")
    (path,) = write_synthetic_dataset(
        root,
        layout=layout,
        num_episodes=3,
        episode_length=(14, 20),
        fps=FPS,
        cameras=("front", "wrist"),
        image_size=(H, W),
        embodiments=(EmbodimentSpec(name="arm", state_dim=6, action_dim=5),),
        tasks=("pick", "place", "push"),
        seed=3,
        episodes_per_file=per_file,
    )
    return path


def test_values_round_trip_exactly(dataset_root):
    ds = LeRobotDataset(dataset_root, image_dtype="uint8", camera_keys=[])
    lengths = [ep.length for ep in ds.episodes]
    assert len(ds) == sum(lengths) and ds.num_episodes == 3
    assert len(set(lengths)) > 1  # the range produced episodes of different lengths
    info = json.loads((dataset_root / "meta/info.json").read_text())
    assert info["total_frames"] == len(ds)
    for i in range(len(ds)):
        s = ds[i]
        ep, f = int(s["episode_index"]), int(s["frame_index"])
        assert torch.equal(s["observation.state"], torch.from_numpy(synthetic_state(ep, f, 6)))
        assert torch.equal(s["action"], torch.from_numpy(synthetic_action(ep, f, 5)))
        assert s["timestamp"].item() == np.float32(f / FPS)
        assert int(s["index"]) == i  # global index == position when all episodes are read
        assert s["task"] == ds.episodes[ep].tasks[0]
        assert int(s["embodiment_id"]) == 0
        assert s["observation.state"].dtype == torch.float32


def test_frames_within_codec_tolerance(dataset_root):
    ds = LeRobotDataset(dataset_root, image_dtype="uint8")
    for i in range(len(ds)):
        s = ds[i]
        ep, f = int(s["episode_index"]), int(s["frame_index"])
        length = ds.episodes[ep].length
        for cam, key in enumerate(ds.camera_keys):
            got = s[key]
            assert got.shape == (3, H, W) and got.dtype == torch.uint8
            got = got.permute(1, 2, 0).numpy().astype(np.int64)
            every = synthetic_frame(ep, np.arange(length), cam, H, W).astype(np.int64)
            err = np.abs(every - got)
            assert err[f].mean() <= MEAN_TOL and err[f].max() <= MAX_TOL, (i, key)
            assert int(err.mean(axis=(1, 2, 3)).argmin()) == f, (i, key)


def test_float_frames_match_uint8(dataset_root):
    as_u8 = LeRobotDataset(dataset_root, image_dtype="uint8")[5]
    as_f32 = LeRobotDataset(dataset_root)[5]
    for key in ("observation.images.front", "observation.images.wrist"):
        assert as_f32[key].dtype == torch.float32
        torch.testing.assert_close(as_f32[key], as_u8[key].float() / 255, rtol=0, atol=1e-7)


def test_action_chunks_and_pads_at_episode_bounds(dataset_root):
    offsets = list(range(-2, 8))
    ds = LeRobotDataset(
        dataset_root,
        camera_keys=[],
        delta_timestamps={"action": [o / FPS for o in offsets], "observation.state": [-0.1, 0.0]},
    )
    for i in range(len(ds)):
        s = ds[i]
        ep, f = int(s["episode_index"]), int(s["frame_index"])
        length = ds.episodes[ep].length
        target = np.array(offsets) + f
        clamped = np.clip(target, 0, length - 1)
        assert torch.equal(s["action"], torch.from_numpy(synthetic_action(ep, clamped, 5)))
        assert s["action_is_pad"].tolist() == ((target < 0) | (target >= length)).tolist()
        assert s["observation.state"].shape == (2, 6)
        assert s["observation.state_is_pad"].tolist() == [f == 0, False]
    # Spot checks of the bounds themselves: first and last frame of episode 1.
    start, end = ds.episode_ranges[1]
    assert ds[start]["action_is_pad"].tolist() == [True, True] + [False] * 8
    last = ds[end - 1]
    assert last["action_is_pad"].tolist() == [False, False, False] + [True] * 7
    assert torch.equal(last["action"][3:], last["action"][2:3].expand(7, 5))


def test_video_deltas_stack_frames_with_pads(dataset_root):
    ds = LeRobotDataset(
        dataset_root,
        image_dtype="uint8",
        camera_keys=["observation.images.front"],
        delta_timestamps={"observation.images.front": [-0.2, -0.1, 0.0]},
    )
    start, end = ds.episode_ranges[2]
    for pos, pads in ((start, [True, True, False]), (start + 1, [True, False, False])):
        s = ds[pos]
        frames = s["observation.images.front"]
        assert frames.shape == (3, 3, H, W)
        assert s["observation.images.front_is_pad"].tolist() == pads
        f = int(s["frame_index"])
        for j, o in enumerate((-2, -1, 0)):
            ref = synthetic_frame(2, max(f + o, 0), 0, H, W).astype(np.int64)
            got = frames[j].permute(1, 2, 0).numpy().astype(np.int64)
            assert np.abs(ref - got).mean() <= MEAN_TOL
    s = ds[end - 1]
    assert not s["observation.images.front_is_pad"].any()


def test_episode_subset_and_explicit_embodiment(dataset_root):
    ds = LeRobotDataset(dataset_root, episodes=[2, 0], camera_keys=[], embodiment_id=7)
    assert [ep.index for ep in ds.episodes] == [0, 2]
    assert len(ds) == ds.episodes[0].length + ds.episodes[1].length
    s = ds[ds.episodes[0].length]
    assert int(s["episode_index"]) == 2 and int(s["frame_index"]) == 0
    assert int(s["embodiment_id"]) == 7
    with pytest.raises(ValueError, match=r"episodes \[5\] are not in"):
        LeRobotDataset(dataset_root, episodes=[5])


def test_writer_files_follow_lerobot_layout(dataset_root):
    info = json.loads((dataset_root / "meta/info.json").read_text())
    layout = info["codebase_version"]
    assert list(info)[:5] == [
        "codebase_version",
        "robot_type",
        "total_episodes",
        "total_frames",
        "total_tasks",
    ]
    feats = info["features"]
    assert list(feats)[-5:] == ["timestamp", "frame_index", "episode_index", "index", "task_index"]
    assert feats["observation.state"] == {
        "dtype": "float32",
        "shape": [6],
        "names": [f"joint_{i}" for i in range(6)],
    }
    cam = feats["observation.images.front"]
    assert cam["dtype"] == "video" and cam["shape"] == [H, W, 3]
    assert cam["names"] == ["height", "width", "channels"]
    assert cam["info"]["video.codec"] == "h264" and cam["info"]["video.pix_fmt"] == "yuv420p"
    assert info["splits"] == {"train": "0:3"} and info["fps"] == FPS
    stats = json.loads((dataset_root / "meta/stats.json").read_text())
    assert set(stats["action"]) == {"min", "max", "mean", "std", "count"} | {
        "q01",
        "q10",
        "q50",
        "q90",
        "q99",
    }
    assert np.asarray(stats["observation.images.front"]["mean"]).shape == (3, 1, 1)
    modality = json.loads((dataset_root / "meta/modality.json").read_text())
    assert modality["state"]["gripper"] == {
        "start": 5,
        "end": 6,
        "original_key": "observation.state",
    }
    assert modality["video"]["front"] == {"original_key": "observation.images.front"}

    data_files = sorted((dataset_root / "data").glob("*/*.parquet"))
    schema = pq.read_schema(data_files[0])
    assert schema.names == [
        "observation.state",
        "action",
        "embodiment_id",
        "timestamp",
        "frame_index",
        "episode_index",
        "index",
        "task_index",
    ]
    assert schema.field("action").type == pa.list_(pa.float32(), 5)
    assert schema.field("timestamp").type == pa.float32()
    assert schema.field("index").type == pa.int64()
    hf = json.loads(schema.metadata[b"huggingface"])["info"]["features"]
    assert hf["timestamp"] == {"dtype": "float32", "_type": "Value"}
    assert hf["action"]["length"] == 5

    if layout == "v2.1":
        assert info["data_path"] == (
            "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
        )
        assert (
            dataset_root / "videos/chunk-000/observation.images.front/episode_000002.mp4"
        ).is_file()
        lines = (dataset_root / "meta/episodes.jsonl").read_text().splitlines()
        assert set(json.loads(lines[0])) == {"episode_index", "tasks", "length"}
        stats_line = json.loads(
            (dataset_root / "meta/episodes_stats.jsonl").read_text().split("\n")[0]
        )
        assert stats_line["episode_index"] == 0 and "action" in stats_line["stats"]
        task_line = json.loads((dataset_root / "meta/tasks.jsonl").read_text().split("\n")[0])
        assert set(task_line) == {"task_index", "task"}
    else:
        assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
        eps = pq.read_table(dataset_root / "meta/episodes/chunk-000/file-000.parquet")
        names = eps.column_names
        assert names[:7] == [
            "episode_index",
            "tasks",
            "length",
            "data/chunk_index",
            "data/file_index",
            "dataset_from_index",
            "dataset_to_index",
        ]
        assert names[-2:] == ["meta/episodes/chunk_index", "meta/episodes/file_index"]
        for col in ("chunk_index", "file_index", "from_timestamp", "to_timestamp"):
            assert f"videos/observation.images.wrist/{col}" in names
        assert "stats/action/q99" in names and "stats/observation.images.front/mean" in names
        rows = eps.to_pylist()
        for row in rows:
            span = (
                row["videos/observation.images.front/to_timestamp"]
                - row["videos/observation.images.front/from_timestamp"]
            )
            assert span == pytest.approx(row["length"] / FPS, abs=1e-9)
            assert row["dataset_to_index"] - row["dataset_from_index"] == row["length"]
        tasks = pq.read_table(dataset_root / "meta/tasks.parquet")
        assert tasks.column_names == ["task_index", "task"]
        assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]


def test_samples_do_not_alias_the_dataset(dataset_root):
    ds = LeRobotDataset(dataset_root, camera_keys=[])
    s = ds[3]
    s["observation.state"] += 100.0
    assert torch.equal(ds[3]["observation.state"], torch.from_numpy(synthetic_state(0, 3, 6)))
