"""Real datasets through the run's assembly (``build_training``, core's ``Trainer``, the CLI):
cameras of different sizes resized per camera to the model's image size, ``data.cameras``,
state/action widths and unknown cameras refused before the model is built, per-frame task
strings in the batch, ``data.verify``, and a corrupt file stopping the CLI with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.data.batch_plan import batch_layout
from longboat.core.train import Trainer
from longboat.embodied.cli import main
from longboat.embodied.data import EmbodimentSpec, LeRobotFormatError, write_synthetic_dataset
from longboat.embodied.data.synthetic import synthetic_state
from longboat.embodied.models import get_config
from longboat.embodied.models.common.image_preprocessing import resize_with_pad
from longboat.embodied.train import training as training_module
from longboat.embodied.train.policy_batch import ByteTokenizer, unit_float
from longboat.embodied.train.training import build_training, open_run_data

pytestmark = pytest.mark.usefixtures("one_thread")

FRONT, WRIST = "observation.images.front", "observation.images.wrist"
EXPERIMENT = {"groot_n1_6": "groot_n1_6_tiny", "pi05": "pi05_tiny"}


def _compose(model: str, out: Path, data: Path, *extra: str):
    return compose_experiment(
        EXPERIMENT[model],
        [
            f"output_dir={out}",
            f"data.path={data}",
            "train.steps=2",
            "train.micro_batch_size=2",
            "train.global_batch_size=null",
            "logging.progress=false",
            "logging.trackers=[]",
            "export.enabled=false",
            *extra,
        ],
        world_size=1,
    )


@pytest.fixture(scope="module")
def two_sizes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Front camera 96x64 (portrait), wrist 48x48: different sizes and aspect ratios."""
    (root,) = write_synthetic_dataset(
        tmp_path_factory.mktemp("two_sizes") / "ds",
        num_episodes=2,
        episode_length=(12, 12),
        camera_sizes={"front": (96, 64), "wrist": (48, 48)},
    )
    return root


@pytest.mark.parametrize("model", ["groot_n1_6", "pi05"])
def test_cameras_of_different_sizes_are_resized_per_camera_and_train(
    tmp_path: Path, two_sizes: Path, model: str
) -> None:
    cfg = _compose(model, tmp_path / "run", two_sizes)
    training = build_training(cfg)
    try:
        size = training.model_cfg.input_image_size()
        assert size == {"groot_n1_6": (56, 84), "pi05": (56, 56)}[model]
        data = training.data
        assert data.resized and data.image_hw == size
        assert data.camera_sizes == {FRONT: [(96, 64)], WRIST: [(48, 48)]}
        samples = [data.dataset[i] for i in (0, 13)]
        images = data.collate(samples)["images"]
        cams = {"groot_n1_6": 2, "pi05": 3}[model]  # pi0.5 takes 3: the third a masked zero
        assert images.shape == (2, cams, 3, *size) and images[:, 2:].abs().sum() == 0
        for row, sample in enumerate(samples):
            for cam, key in enumerate((FRONT, WRIST)):
                frame = unit_float(sample[key][None])  # frames are read as uint8
                if model == "pi05":  # openpi's resize_with_pad: aspect kept, black padding
                    want = resize_with_pad(frame, 56)[0]
                else:  # GR00T: one plain resize to the model's image size
                    want = F.interpolate(frame, size=size, mode="bilinear", antialias=True)[0]
                torch.testing.assert_close(images[row, cam], want, rtol=0, atol=0)
        if model == "pi05":  # 96x64 -> 56x37 centred: 9 black columns left, 10 right
            assert images[:, 0, :, :, :9].abs().max() == 0 and images[:, 0, :, :, -10:].max() == 0
            assert images[:, 0, :, :, 9:-10].amin(dim=(-1, -2)).min() > 0
        result = Trainer(cfg, training).fit()
    finally:
        training.close()
    assert result.end_step == 2 and all(np.isfinite(result.losses))


def test_one_camera_size_reaches_the_model_as_read(tmp_path: Path) -> None:
    (root,) = write_synthetic_dataset(
        tmp_path / "ds", num_episodes=2, episode_length=(12, 12), image_size=(48, 64)
    )
    cfg = _compose("groot_n1_6", tmp_path / "run", root)
    model_cfg = get_config("groot_n1_6", "tiny", {})
    data = open_run_data(training_module.typed_config(cfg), model_cfg, batch_layout(2, 2, 1), True)
    assert not data.resized and data.image_hw == (48, 64)  # the model's own resize does it
    sample = data.dataset[0]
    images = data.collate([sample])["images"]
    assert torch.equal(images[0, 0], sample[FRONT]) and torch.equal(images[0, 1], sample[WRIST])


def _refuse_model_building(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(training_module, "build_policy", no_model)


def test_data_cameras_selects_and_orders_the_cameras(
    tmp_path: Path, two_sizes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _compose("pi05", tmp_path / "run", two_sizes, f"data.cameras=[{WRIST},{FRONT}]")
    training = build_training(cfg)
    try:
        assert training.data.cameras == [WRIST, FRONT]
        sample = training.data.dataset[3]
        batch = training.data.collate([sample])
        torch.testing.assert_close(
            batch["images"][0, 0], resize_with_pad(unit_float(sample[WRIST][None]), 56)[0]
        )
        assert batch["image_mask"].tolist() == [[True, True, False]]  # pi05 takes 3 cameras
    finally:
        training.close()
    only = _compose("pi05", tmp_path / "run2", two_sizes, f"data.cameras=[{WRIST}]")
    training = build_training(only)
    try:
        assert training.data.cameras == [WRIST] and not training.data.resized
    finally:
        training.close()

    _refuse_model_building(monkeypatch)
    bad = _compose("pi05", tmp_path / "run3", two_sizes, "data.cameras=[observation.images.top]")
    with pytest.raises(ConfigError) as err:
        build_training(bad)
    assert err.value.keys == ["data.cameras"]
    text = str(err.value)
    assert "['observation.images.top']" in text and f"['{FRONT}', '{WRIST}']" in text
    assert "Fix: pick from" in text


@pytest.mark.parametrize(
    ("model", "spec", "key", "feature", "dims"),
    [
        ("groot_n1_6", dict(state_dim=12, action_dim=5), "max_state_dim", "observation.state", 12),
        ("groot_n1_6", dict(state_dim=6, action_dim=9), "max_action_dim", "action", 9),
        ("pi05", dict(state_dim=6, action_dim=10), "action_dim", "action", 10),
    ],
)
def test_state_and_action_widths_are_checked_before_the_model_is_built(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    spec: dict,
    key: str,
    feature: str,
    dims: int,
) -> None:
    (root,) = write_synthetic_dataset(
        tmp_path / "ds",
        num_episodes=1,
        episode_length=(12, 12),
        cameras=("front",),
        embodiments=(EmbodimentSpec(name="wide", **spec),),
    )
    _refuse_model_building(monkeypatch)
    with pytest.raises(ConfigError) as err:
        build_training(_compose(model, tmp_path / "run", root))
    assert err.value.keys == [f"model.overrides.{key}"]
    text = str(err.value)
    assert f"{feature} of {root} has {dims} dims, more than the model's {key}=8" in text
    assert f"Fix: set model.overrides.{key}={dims} (or larger)" in text


def test_the_fix_of_the_width_error_trains(tmp_path: Path) -> None:
    (root,) = write_synthetic_dataset(
        tmp_path / "ds",
        num_episodes=1,
        episode_length=(12, 12),
        cameras=("front",),
        embodiments=(EmbodimentSpec(name="wide", state_dim=12, action_dim=5),),
    )
    cfg = _compose("groot_n1_6", tmp_path / "run", root, "model.overrides.max_state_dim=12")
    training = build_training(cfg)
    try:
        batch = training.data.collate([training.data.dataset[0]])
        assert batch["state"].shape == (1, 12) and bool(batch["state_mask"].all())
        assert Trainer(cfg, training).fit().end_step == 2
    finally:
        training.close()


def test_per_frame_task_strings_reach_the_batch(tmp_path: Path) -> None:
    tasks = ("pick up the red cube", "open the drawer", "wipe the table")
    (root,) = write_synthetic_dataset(
        tmp_path / "ds",
        layout="v2.1",
        num_episodes=4,
        episode_length=(10, 10),
        cameras=("front",),
        tasks=tasks,
        seed=3,
    )
    rows = [json.loads(line) for line in (root / "meta/tasks.jsonl").read_text().splitlines()]
    table_tasks = {r["task_index"]: r["task"] for r in rows}
    assert len(table_tasks) >= 2
    # Episode 0 changes task half-way (LeRobot stores the task per frame).
    path = root / "data/chunk-000/episode_000000.parquet"
    table = pq.read_table(path)
    per_frame = [0] * 5 + [1] * 5
    i = table.schema.get_field_index("task_index")
    pq.write_table(table.set_column(i, "task_index", pa.array(per_frame, pa.int64())), path)
    cfg = training_module.typed_config(_compose("pi05", tmp_path / "run", root))
    model_cfg = get_config("pi05", "tiny", {})
    data = open_run_data(cfg, model_cfg, batch_layout(2, 2, 1), True)
    spec = data.collate.spec
    tokenizer = ByteTokenizer(spec.vocab_limit)
    samples = [data.dataset[i] for i in range(len(data.dataset))]
    batch = data.collate(samples)
    frame_tasks = np.concatenate(
        [pq.read_table(p).column("task_index").to_numpy() for p in sorted(root.glob("data/*/*"))]
    )
    seen = set()
    for row, (sample, task_index) in enumerate(zip(samples, frame_tasks, strict=True)):
        task = table_tasks[int(task_index)]
        assert sample["task"] == task
        ids = tokenizer.encode(task)[: spec.max_text_tokens]
        assert batch["input_ids"][row, : len(ids)].tolist() == ids
        assert int(batch["attention_mask"][row].sum()) == len(ids)
        seen.add(task)
    assert samples[4]["task"] == table_tasks[0] and samples[5]["task"] == table_tasks[1]
    assert len(seen) >= 2


def test_data_verify_prints_its_summary_and_fails_listing_the_problems(
    tmp_path: Path, two_sizes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _compose("groot_n1_6", tmp_path / "run", two_sizes, "data.verify=true")
    training = build_training(cfg)
    try:
        lines = training.describe()
    finally:
        training.close()
    assert any(
        line.startswith("data.verify: 1 data file(s), 2 video file(s), 2 episode(s), 24 frame(s)")
        and line.endswith("no problems")
        for line in lines
    )
    (root,) = write_synthetic_dataset(tmp_path / "bad", num_episodes=2, episode_length=(12, 12))
    video = root / "videos/observation.images.wrist/chunk-000/file-000.mp4"
    video.write_bytes(video.read_bytes()[:200])
    _refuse_model_building(monkeypatch)
    with pytest.raises(LeRobotFormatError) as err:
        build_training(_compose("groot_n1_6", tmp_path / "run2", root, "data.verify=true"))
    first, listed = str(err.value).splitlines()
    assert first.endswith("1 problem(s):") and listed.startswith(f"  - {video}: video ")
    assert "episode 0, 1" in listed


def test_frames_far_outside_stats_are_skipped_with_skip_bad_samples(tmp_path: Path) -> None:
    (root,) = write_synthetic_dataset(
        tmp_path / "ds", layout="v2.1", num_episodes=2, episode_length=(12, 12), cameras=("front",)
    )
    path = root / "data/chunk-000/episode_000001.parquet"
    table = pq.read_table(path)
    pq.write_table(table, path, compression="none")
    data = path.read_bytes()
    old = synthetic_state(1, 4, 6)[1].tobytes()
    path.write_bytes(data.replace(old, np.float32(-1.18e29).tobytes()))
    with pytest.raises(LeRobotFormatError, match=r"episode 1, frame 4: observation.state\[1\]"):
        build_training(_compose("groot_n1_6", tmp_path / "run", root))
    cfg = _compose("groot_n1_6", tmp_path / "run2", root, "data.skip_bad_samples=true")
    training = build_training(cfg)
    try:
        assert training.data.bad_frames == 1
        assert any("skipping 1 frame(s) with values far outside" in x for x in training.describe())
        result = Trainer(cfg, training).fit()
    finally:
        training.close()
    assert result.end_step == 2 and all(np.isfinite(result.losses))


def test_cli_corrupt_parquet_exits_2_naming_file_and_episode_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (root,) = write_synthetic_dataset(
        tmp_path / "ds", layout="v2.1", num_episodes=2, episode_length=(12, 12), cameras=("front",)
    )
    path = root / "data/chunk-000/episode_000001.parquet"
    path.write_bytes(path.read_bytes()[:-100])
    args = ["train", "experiment=groot_n1_6_tiny", f"output_dir={tmp_path / 'run'}"]
    args += [f"data.path={root}", "logging.progress=false"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"longboat-embodied: error: {path}: unreadable parquet (episode 1): ")
    assert "Traceback" not in err and err.count("\n") == 1
    with pytest.raises(LeRobotFormatError, match="unreadable parquet"):  # --debug: the traceback
        main(["train", "--debug", *args[1:]])
