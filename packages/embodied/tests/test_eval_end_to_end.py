"""A trained policy in closed loop: a tiny pi0.5 trained for two steps on a synthetic dataset
shaped like PushT (one 96x96 camera ``top``, a 2-value state and action) is evaluated by
``longboat-embodied eval`` on rendered PushT episodes: the table, the success counts, one
mp4 decoded frame by frame, and a second run with the same seed, and the run's LeRobot-format
export, giving the same episodes.
During training, ``train.sim_eval`` logs the success rate beside the loss from a child
process, and a simulator that fails is logged as a failed evaluation while training ends
normally. Bad ``train.sim_eval`` keys are refused before anything is built."""

from __future__ import annotations

import json
import re
from pathlib import Path

import av
import pytest
from embodied_testkit import read_metrics

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.embodied.cli import main
from longboat.embodied.data import write_synthetic_dataset
from longboat.embodied.data.synthetic import EmbodimentSpec
from longboat.embodied.eval.suite import load_suite
from longboat.embodied.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")


def _overrides(run: Path, data: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={run}",
        f"data.path={data}",
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",
        "train.precision=fp32",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.save_on_exit=false",
        *extra,
    ]


@pytest.fixture(scope="module")
def pusht_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic LeRobot dataset with PushT's camera, state and action widths."""
    root = tmp_path_factory.mktemp("pusht_like") / "data"
    (path,) = write_synthetic_dataset(
        root,
        num_episodes=2,
        episode_length=(12, 12),
        cameras=("top",),
        image_size=(96, 96),
        embodiments=(EmbodimentSpec(name="pusht", state_dim=2, action_dim=2),),
        tasks=("Push the T-shaped block onto the T-shaped target.",),
    )
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, pusht_data: Path) -> Path:
    run = tmp_path_factory.mktemp("pusht_run")
    cfg = compose_experiment("pi05_tiny", _overrides(run, pusht_data), world_size=1)
    assert len(train(cfg).losses) == 2
    return run


def _eval(run: Path, out: Path) -> dict:
    argv = ["eval", str(run), "--suite", "pusht", "--episodes", "3", "--num-envs", "2",
            "--max-steps", "12", "--videos", "1", "--seed", "3", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())


def test_a_trained_policy_is_evaluated_with_table_counts_and_video(
    trained: Path, tmp_path: Path, capsys
) -> None:
    results = _eval(trained, tmp_path / "a")
    printed = capsys.readouterr().out
    (task,) = results["tasks"]
    episodes = task["per_episode"]
    assert [e["episode"] for e in episodes] == [0, 1, 2]
    assert [e["seed"] for e in episodes] == [3, 4, 5]
    wins = sum(e["success"] for e in episodes)
    assert task["successes"] == results["total"]["successes"] == wins
    assert task["episodes"] == results["total"]["episodes"] == 3
    # an episode ends at max_steps, or earlier only by succeeding
    assert all(e["steps"] == 12 or (e["success"] and e["steps"] < 12) for e in episodes)
    row = re.escape(f"| pusht | 3 | {wins} | {100 * wins / 3:.1f}% |")
    table = (tmp_path / "a" / "results.md").read_text()
    assert re.search(row, table) and re.search(row, printed)
    assert "95% CI (Wilson)" in table
    assert results["videos"] == ["videos/pusht_ep000.mp4"]
    with av.open(str(tmp_path / "a" / "videos" / "pusht_ep000.mp4")) as video:
        frames = [f.to_ndarray(format="rgb24") for f in video.decode(video=0)]
    assert len(frames) == episodes[0]["steps"] + 1  # the reset frame and one per step
    assert frames[0].shape == (256, 256, 3)  # the suite's render size
    # the same seed: the same episodes, step for step; so does the LeRobot-format export
    again = _eval(trained, tmp_path / "b")
    assert again["tasks"][0]["per_episode"] == episodes
    lerobot = _eval(trained / "export" / "lerobot", tmp_path / "c")
    assert lerobot["tasks"][0]["per_episode"] == episodes


def test_training_logs_the_success_rate_from_a_child_process(
    pusht_data: Path, tmp_path: Path, capsys
) -> None:
    extra = ("train.eval_every=2", "train.sim_eval.suite=pusht", "train.sim_eval.episodes=2",
             "train.sim_eval.num_envs=2", "train.sim_eval.max_steps=4",
             "train.sim_eval.videos=0")  # fmt: skip
    run = tmp_path / "run"
    cfg = compose_experiment("pi05_tiny", _overrides(run, pusht_data, *extra), world_size=1)
    result = train(cfg)
    assert len(result.losses) == 2 and result.export_dir is not None
    assert "Eval sim_success_rate at step 2: " in capsys.readouterr().out
    rows = read_metrics(run, "pi05_tiny")
    (row,) = [r for r in rows if "sim_success_rate" in r]
    assert row["step"] == 2 and "loss" in row  # beside the loss, at eval_every and the end
    assert row["sim_eval_failed"] == 0.0 and row["sim_episodes"] == 2.0
    results = json.loads((run / "sim_eval" / "step_00000002" / "results.json").read_text())
    assert row["sim_success_rate"] == results["total"]["success_rate"]
    assert [e["steps"] <= 4 for e in results["tasks"][0]["per_episode"]] == [True, True]
    assert not (run / "sim_eval" / "policy").exists()  # the weights it read are removed


@pytest.mark.slow
def test_a_simulator_failure_is_logged_and_training_goes_on(
    pusht_data: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.yaml"  # an environment id gymnasium cannot make
    broken.write_text(
        load_suite("pusht").path.read_text().replace("PushT-v0", "NoSuchEnvironment-v0")
    )
    extra = ("train.eval_every=2", f"train.sim_eval.suite={broken}", "train.sim_eval.episodes=1")
    run = tmp_path / "run"
    cfg = compose_experiment("pi05_tiny", _overrides(run, pusht_data, *extra), world_size=1)
    result = train(cfg)
    assert len(result.losses) == 2 and result.export_dir is not None
    (row,) = [r for r in read_metrics(run, "pi05_tiny") if "sim_eval_failed" in r]
    assert row["sim_eval_failed"] == 1.0 and "sim_success_rate" not in row
    log = (run / "sim_eval" / "step_00000002" / "eval.log").read_text()
    assert "NoSuchEnvironment" in log


def test_bad_sim_eval_keys_are_refused_before_training(pusht_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        compose_experiment("pi05_tiny", _overrides(run, pusht_data, "train.sim_eval.suite=nope",
                                                   "train.sim_eval.episodes=0"))  # fmt: skip
    assert sorted(err.value.keys) == ["train.sim_eval.episodes", "train.sim_eval.suite"]
    assert "pusht" in str(err.value)
    no_sim = tmp_path / "no_sim.yaml"  # a suite whose simulator is not installed
    no_sim.write_text(
        load_suite("pusht").path.read_text().replace("[gym_pusht]", "[longboat_no_such_sim]")
    )
    with pytest.raises(ConfigError) as err:
        compose_experiment("pi05_tiny", _overrides(run, pusht_data, "train.eval_every=1",
                                                   f"train.sim_eval.suite={no_sim}"))  # fmt: skip
    assert err.value.keys == ["train.sim_eval.suite"]
    assert "longboat-embodied[sim]" in str(err.value)
    # a suite the run's data cannot feed: refused before the model is built
    other = tmp_path / "other_cam.yaml"
    other.write_text(
        load_suite("pusht")
        .path.read_text()
        .replace("observation.images.top", "observation.images.side")
    )
    cfg = compose_experiment("pi05_tiny", _overrides(run, pusht_data,
                                                     f"train.sim_eval.suite={other}"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"observation\.images\.top"):
        train(cfg)
    assert not (run / "checkpoints").exists()
