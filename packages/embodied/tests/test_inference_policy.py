"""An exported policy acts on raw observations (``longboat.embodied.inference``): every
export carries its processor (``processor.json``, the tokenizer inside), and
``load_policy(dir).predict_action_chunk(frame)`` on a raw LeRobot frame returns what the
policy predicts on the training run's own batch of that frame, unnormalised into the
robot's units; ``select_action`` hands the chunk out one action at a time. The README's
three lines run as written."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from embodied_testkit import write_tiny_qwen_tokenizer, write_tiny_tokenizer

from longboat.core.config.compose import compose_experiment
from longboat.embodied.data import LeRobotDataset
from longboat.embodied.inference import load_policy
from longboat.embodied.inference.processor import PROCESSOR_NAME
from longboat.embodied.train.policy_batch import ACTION_KEY
from longboat.embodied.train.trainer import train
from longboat.embodied.train.training import build_training

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).parents[1] / "README.md"


def _overrides(run: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={run}",
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",
        "optim.lr=1e-3",
        "optim.schedule.warmup_steps=0",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.save_on_exit=false",
        "data.synthetic.num_episodes=2",
        "data.synthetic.episode_length=12",
        *extra,
    ]


def _run(experiment: str, run: Path, *extra: str):
    cfg = compose_experiment(experiment, _overrides(run, *extra), world_size=1)
    assert len(train(cfg).losses) == 2
    return compose_experiment(experiment, _overrides(run, *extra), world_size=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """Two-step runs: pi0.5 from scratch (its stand-in tokenizer), with the byte-level
    stand-in and with a tokenizer, GR00T and SmolVLA from scratch (the byte-level stand-in)
    and with a tokenizer; (run dir, its config) each."""
    root = tmp_path_factory.mktemp("inference")
    pi_tok = write_tiny_tokenizer(root / "pi_tokenizer")
    groot_tok = write_tiny_qwen_tokenizer(root / "groot_tokenizer")
    out = {}
    for name, experiment, extra in (
        ("pi05", "pi05_tiny", ()),  # from scratch: the stand-in tokenizer, shipped
        ("pi05_byte", "pi05_tiny", ("model.tokenizer=byte",)),
        ("pi05_tok", "pi05_tiny", (f"model.tokenizer={pi_tok}",)),
        ("groot", "groot_n1_6_tiny", ()),
        ("groot_tok", "groot_n1_6_tiny", (f"model.tokenizer={groot_tok}",)),
        ("smolvla", "smolvla_tiny", ()),
        ("smolvla_tok", "smolvla_tiny", (f"model.tokenizer={pi_tok}",)),
    ):
        run = root / name
        out[name] = (run, _run(experiment, run, *extra))
    return out


def _reference(cfg, index: int, noise: torch.Tensor) -> torch.Tensor:
    """The exported policy's actions on the training run's own batch of sample ``index``,
    unnormalised with the dataset's normaliser: what acting on the raw frame must give."""
    from longboat.embodied.train.export import load_exported_policy

    training = build_training(cfg)
    sample = training.data.dataset[index]
    batch = training.data.collate([sample])
    model = load_exported_policy(Path(cfg.output_dir) / "export").eval()
    with torch.no_grad():
        actions = model.predict_action(batch, noise=noise[None])
    width = sample[ACTION_KEY].shape[-1]
    norm = training.data.dataset.normalizer
    return norm.unnormalize(ACTION_KEY, actions[0, :, :width].float()).float()


@pytest.mark.parametrize(
    "name", ["pi05", "pi05_byte", "pi05_tok", "groot", "groot_tok", "smolvla", "smolvla_tok"]
)
def test_raw_frame_gives_the_training_batch_actions_in_robot_units(runs, name: str) -> None:
    run, cfg = runs[name]
    export = run / "export"
    assert (export / PROCESSOR_NAME).is_file()
    tokenizers = ("pi05", "pi05_tok", "groot_tok", "smolvla_tok")
    assert (export / "tokenizer").is_dir() == (name in tokenizers)
    policy = load_policy(export)
    frame = LeRobotDataset(run / "dataset")[5]  # float frames, state in the robot's units
    spec = policy.processor.spec
    noise = torch.randn(spec.horizon, spec.action_dim, generator=torch.Generator().manual_seed(3))
    got = policy.predict_action_chunk(frame, noise=noise)
    want = _reference(cfg, 5, noise)
    assert got.shape == want.shape == (spec.horizon, frame[ACTION_KEY].shape[-1])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # Robot units: the dataset's min / max ([-1, 1] for the policy) come back as they are.
    norm = policy.processor.embodiment(0).normalizer
    stats = LeRobotDataset(run / "dataset").meta.stats[ACTION_KEY]
    ends = norm.unnormalize(ACTION_KEY, torch.tensor([[-1.0], [1.0]]).expand(2, got.shape[-1]))
    torch.testing.assert_close(ends[0], torch.as_tensor(stats["min"]).float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ends[1], torch.as_tensor(stats["max"]).float(), rtol=0, atol=1e-5)

    # The same frame as a camera gives it (uint8 [H, W, C] numpy) acts the same.
    camera = {k: (v.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy() for k, v in
              frame.items() if k in policy.cameras}  # fmt: skip
    raw = {**camera, "observation.state": frame["observation.state"].numpy(), "task": frame["task"]}
    torch.testing.assert_close(policy.predict_action_chunk(raw, noise=noise), got, rtol=0, atol=0)


def test_select_action_hands_out_the_chunk_then_samples_again(runs) -> None:
    run, _ = runs["pi05"]
    policy = load_policy(run / "export", n_action_steps=3)
    frame = LeRobotDataset(run / "dataset")[0]
    torch.manual_seed(11)
    chunk = policy.predict_action_chunk(frame)
    torch.manual_seed(11)
    first = [policy.select_action(frame) for _ in range(3)]
    torch.testing.assert_close(torch.stack(first), chunk[:3], rtol=0, atol=0)
    torch.manual_seed(12)
    fourth = policy.select_action(frame)  # a new chunk, sampled with other noise
    torch.manual_seed(12)
    torch.testing.assert_close(fourth, policy.predict_action_chunk(frame)[0], rtol=0, atol=0)
    policy.reset()
    torch.manual_seed(11)
    torch.testing.assert_close(policy.select_action(frame), chunk[0], rtol=0, atol=0)


def test_bad_observations_name_what_is_missing(runs) -> None:
    run, _ = runs["groot"]
    policy = load_policy(run / "export")
    frame = LeRobotDataset(run / "dataset")[0]
    with pytest.raises(KeyError, match=r"observation\.state"):
        policy.predict_action_chunk({k: v for k, v in frame.items() if k != "observation.state"})
    with pytest.raises(ValueError, match="has a state of 6"):
        policy.predict_action_chunk({**frame, "observation.state": torch.zeros(9)})
    with pytest.raises(ValueError, match=r"\[H, W, 3\] or \[3, H, W\]"):
        policy.predict_action_chunk({**frame, policy.cameras[0]: torch.zeros(5, 7)})


@pytest.mark.parametrize(
    ("name", "fmt"), [("pi05", "lerobot"), ("pi05_tok", "lerobot"), ("groot_tok", "isaac")]
)
def test_reference_format_folder_acts_alone_after_a_move(
    runs, name: str, fmt: str, tmp_path: Path
) -> None:
    """The LeRobot / Isaac folder carries the processor and the tokenizer: moved away from
    the run, it acts as the native export does."""
    run, _ = runs[name]
    moved = tmp_path / "moved"
    shutil.copytree(run / "export" / fmt, moved)
    frame = LeRobotDataset(run / "dataset")[7]
    noise = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    native = load_policy(run / "export")
    spec = native.processor.spec
    noise = noise[: spec.horizon, : spec.action_dim]
    got = load_policy(moved).predict_action_chunk(frame, noise=noise)
    torch.testing.assert_close(
        got, native.predict_action_chunk(frame, noise=noise), rtol=0, atol=1e-5
    )


def _readme_lines() -> str:
    text = README.read_text()
    match = re.search(r"## Act with the exported policy.*?```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its 'Act with the exported policy' example"
    return match.group(1)


def test_readme_three_lines_act_on_a_frame_of_the_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = _readme_lines()
    assert len(code.strip().splitlines()) == 3
    monkeypatch.chdir(tmp_path)
    _run("pi05_tiny", Path("outputs/pi05_tiny"))
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)  # the README's own lines
    action = scope["action"]
    dims = LeRobotDataset(Path("outputs/pi05_tiny/dataset")).meta.features[ACTION_KEY]["shape"]
    assert tuple(action.shape) == (dims[0],) and bool(torch.isfinite(action).all())


def test_command_line_conversion_ships_the_processor(runs, tmp_path: Path) -> None:
    """``python -m longboat.embodied.train.lerobot_export`` writes the processor beside the
    converted weights too: the Isaac folder it makes acts as the native export does."""
    from longboat.embodied.train.lerobot_export import main

    run, _ = runs["groot"]
    out = tmp_path / "isaac"
    main([str(run / "export"), str(out), "--dataset", str(run / "dataset")])
    assert (out / PROCESSOR_NAME).read_bytes() == (run / "export" / PROCESSOR_NAME).read_bytes()
    frame = LeRobotDataset(run / "dataset")[2]
    native = load_policy(run / "export")
    spec = native.processor.spec
    noise = torch.randn(spec.horizon, spec.action_dim, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(
        load_policy(out).predict_action_chunk(frame, noise=noise),
        native.predict_action_chunk(frame, noise=noise),
        rtol=0,
        atol=1e-5,
    )


def test_each_embodiment_acts_with_its_own_statistics(tmp_path: Path) -> None:
    """Two embodiments of other widths: a frame of each sub-dataset (its ``embodiment_id``
    picks its normaliser) gives the training batch's actions in that robot's units."""
    cfg = _run("groot_n1_6_tiny", tmp_path / "run", "data.synthetic.num_embodiments=2")
    policy = load_policy(tmp_path / "run" / "export")
    assert [e.state_dim for e in policy.processor.embodiments] == [6, 7]
    training = build_training(cfg)
    spec = policy.processor.spec
    noise = torch.randn(spec.horizon, spec.action_dim, generator=torch.Generator().manual_seed(8))
    from longboat.embodied.train.export import load_exported_policy

    model = load_exported_policy(tmp_path / "run" / "export").eval()
    for emb, index in ((0, 3), (1, len(training.data.dataset) - 3)):
        sample = training.data.dataset[index]
        assert int(sample["embodiment_id"]) == emb
        part = training.data.dataset.datasets[emb]
        local = index - (len(training.data.dataset.datasets[0]) if emb else 0)
        frame = LeRobotDataset(part.root)[local]
        with torch.no_grad():
            raw = model.predict_action(training.data.collate([sample]), noise=noise[None])
        width = sample[ACTION_KEY].shape[-1]
        want = part.normalizer.unnormalize(ACTION_KEY, raw[0, :, :width].float()).float()
        got = policy.predict_action_chunk(frame, noise=noise)
        assert got.shape == (spec.horizon, 5 + emb)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
