"""The LIBERO suites (``libero_spatial``, ``libero_object``, ``libero_goal``, ``libero_10``).

Without the simulator: every suite YAML is checked against ``eval_libero_spec.json``, the
observation and action spaces and the task lists that ``longboat/Libero-v0`` gave when it
was recorded (``python test_eval_libero.py`` rewrites it, with ``longboat-embodied[libero]``
installed): the cameras and state entries the YAML maps exist with the widths it declares,
the action bounds are the environment's, and each task's id, name and instruction are
LIBERO's. The quaternion -> axis-angle conversion of the state is checked against rotations
built by hand.

With ``longboat-embodied[libero]`` (skipped cleanly without it; slow: MuJoCo renders in
software on a CPU): the live environment still gives the recorded spec, and an episode of
``libero_spatial`` rolls out headless through ``evaluate``: a motionless open gripper never
succeeds, the video has the reset frame and one frame per step of a rendered scene, and the
same seed gives the same scene; a scripted pick-and-place oracle records a demonstration of
a ``libero_object`` task, which replayed through ``evaluate`` succeeds (the success signal
proven), while holding still does not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from longboat.embodied.eval.suite import load_suite

SPEC = Path(__file__).with_name("eval_libero_spec.json")
SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
HAS_LIBERO = importlib.util.find_spec("libero") is not None
needs_libero = pytest.mark.skipif(
    not HAS_LIBERO, reason="LIBERO is not installed (pip install 'longboat-embodied[libero]')"
)


def _flat(obs: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in obs.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def record_spec() -> dict[str, Any]:
    """What ``longboat/Libero-v0`` gives now: the observation entries (shape, dtype) and
    action bounds of one task at the suites' camera size, and every suite's tasks."""
    import gymnasium as gym
    from libero.libero import benchmark

    from longboat.embodied.eval import libero_env

    size = load_suite(SUITES[0]).env_kwargs["camera_size"]
    env = gym.make(libero_env.ENV_ID, suite=SUITES[0], task_id=0, camera_size=size)
    try:
        obs, _ = env.reset(seed=0)
        space = env.action_space
        spec: dict[str, Any] = {
            "env_id": libero_env.ENV_ID,
            "camera_size": size,
            "observation": {
                k: {"shape": list(np.shape(v)), "dtype": str(np.asarray(v).dtype)}
                for k, v in sorted(_flat(obs).items())
            },
            "action": {
                "shape": list(space.shape),
                "low": space.low.tolist(),
                "high": space.high.tolist(),
            },
        }
    finally:
        env.close()
    suites = benchmark.get_benchmark_dict()
    spec["suites"] = {}
    for name in SUITES:
        bench = suites[name]()
        spec["suites"][name] = [
            {
                "task_id": i,
                "name": bench.get_task(i).name,
                "instruction": bench.get_task(i).language,
                "init_states": len(bench.get_task_init_states(i)),
            }
            for i in range(bench.n_tasks)
        ]
    return spec


# --- without the simulator --------------------------------------------------------------------


@pytest.mark.parametrize("name", SUITES)
def test_suite_yaml_matches_the_recorded_environment(name: str) -> None:
    spec = json.loads(SPEC.read_text())
    suite = load_suite(name)
    observed = spec["observation"]
    assert suite.env_kwargs["camera_size"] == spec["camera_size"]
    size = spec["camera_size"]
    for camera, key in suite.cameras.items():
        assert observed[key] == {"shape": [size, size, 3], "dtype": "uint8"}, camera
    widths = [math.prod(observed[key]["shape"]) for key in suite.state]
    assert suite.state_dim == sum(widths) == 8
    assert all(observed[key]["dtype"] == "float64" for key in suite.state)
    assert suite.action_dim == spec["action"]["shape"][0] == 7
    assert suite.action_low == spec["action"]["low"]
    assert suite.action_high == spec["action"]["high"]
    assert suite.success_key == "is_success"
    assert suite.requires == ["libero", "longboat.embodied.eval.libero_env"]
    recorded = spec["suites"][name]
    assert (
        [t.env_id for t in suite.tasks] == [spec["env_id"]] * len(recorded) == [spec["env_id"]] * 10
    )
    got = [
        {"task_id": t.env_kwargs["task_id"], "name": t.name, "instruction": t.instruction}
        for t in suite.tasks
    ]
    assert got == [{k: r[k] for k in ("task_id", "name", "instruction")} for r in recorded]
    assert suite.env_kwargs["suite"] == name
    # --seed 0 --episodes 50 visits every fixed evaluation scene once
    assert {r["init_states"] for r in recorded} == {50}


def test_quaternion_to_axis_angle_matches_hand_built_rotations() -> None:
    pytest.importorskip("gymnasium")
    from longboat.embodied.eval.libero_env import quat_to_axis_angle

    axis = np.array([1.0, 2.0, -2.0]) / 3.0
    for angle in (0.3, 1.7, math.pi - 1e-3):
        quat = np.array([*(axis * math.sin(angle / 2)), math.cos(angle / 2)])
        np.testing.assert_allclose(quat_to_axis_angle(quat), axis * angle, atol=1e-9)
    np.testing.assert_array_equal(quat_to_axis_angle(np.array([0, 0, 0, 1.0])), np.zeros(3))
    # LIBERO's resting end effector (x, y, z, w): about a half turn about x. w crosses 0 there
    # and the state stays continuous, near (pi, 0, 0) on both sides (no q / -q folding)
    for w in (-7.1e-5, 7.1e-5):
        rest = quat_to_axis_angle(np.array([0.9996, -1.8e-4, -2.8e-2, w]))
        assert rest[0] == pytest.approx(math.pi, abs=5e-3) and abs(rest[2]) < 0.1


def test_libero_suites_name_the_extra_when_libero_is_missing(tmp_path: Path) -> None:
    from longboat.core.config.errors import ConfigError
    from longboat.embodied.eval.suite import check_installed

    text = load_suite("libero_goal").path.read_text()
    absent = tmp_path / "absent.yaml"
    absent.write_text(text.replace("requires: [libero,", "requires: [longboat_no_such_libero,"))
    with pytest.raises(ConfigError, match=r"longboat-embodied\[libero\]"):
        check_installed(load_suite(str(absent)))


# --- with the simulator -----------------------------------------------------------------------


class HoldStill:
    """No motion, gripper open: never completes a task."""

    def begin(self, slot, episode) -> None:
        pass

    def act(self, slots, observations) -> np.ndarray:
        return np.tile(np.array([0, 0, 0, 0, 0, 0, -1.0]), (len(slots), 1))


@needs_libero
@pytest.mark.slow
def test_live_environment_gives_the_recorded_spec() -> None:
    assert record_spec() == json.loads(SPEC.read_text())


@needs_libero
@pytest.mark.slow
def test_libero_episode_rolls_out_headless_with_video(tmp_path: Path) -> None:
    import av

    from longboat.embodied.eval.runner import evaluate

    suite = load_suite("libero_spatial")
    small = dataclasses.replace(suite, env_kwargs={**suite.env_kwargs, "camera_size": 64})
    task = suite.tasks[0].name
    runs = []
    for out in ("a", "b"):
        results = evaluate(small, HoldStill(), tmp_path / out, episodes=1, max_steps=3, videos=1,
                           seed=7, tasks=[task], progress=False)  # fmt: skip
        runs.append(results)
    (episode,) = runs[0]["tasks"][0]["per_episode"]
    assert (episode["seed"], episode["success"], episode["steps"]) == (7, False, 3)
    assert runs[1]["tasks"][0]["per_episode"] == runs[0]["tasks"][0]["per_episode"]
    assert runs[0]["videos"] == [f"videos/{task}_ep000.mp4"]
    frames = []
    for out in ("a", "b"):
        with av.open(str(tmp_path / out / "videos" / f"{task}_ep000.mp4")) as video:
            frames.append([f.to_ndarray(format="rgb24") for f in video.decode(video=0)])
    assert len(frames[0]) == 4 and frames[0][0].shape == (64, 64, 3)
    assert frames[0][0].std() > 10  # a rendered scene, not a blank frame
    # the same seed, the same scene (the videos are lossy: compare their decoded frames)
    assert np.abs(frames[0][0].astype(int) - frames[1][0].astype(int)).max() <= 2


def scripted_pick_and_place(env: Any, obs: dict, obj: str, container: str) -> list[list[float]]:
    """A scripted oracle for LIBERO's pick-and-place tasks: from the reset scene (``obs``, the
    reset's observation) it drives the
    end effector (proportional position deltas, orientation held) above ``obj``, down,
    closes the gripper, lifts, carries it above ``container`` and lowers it until the task
    succeeds; returns the actions it took (a demonstration), or fails the test."""
    start = env.unwrapped.object_positions()
    above_obj, above_box = start[obj] + [0, 0, 0.12], start[container] + [0, 0, 0.25]
    phases = [(above_obj, -1.0, 60), (start[obj] + [0, 0, 0.02], -1.0, 40), (None, 1.0, 12),
              (start[obj] + [0, 0, 0.25], 1.0, 50), (above_box, 1.0, 60),
              (start[container] + [0, 0, 0.10], 1.0, 40)]  # fmt: skip
    actions: list[list[float]] = []
    eef = obs["robot_state"]["eef_pos"]
    for target, grip, steps in phases:
        hold = target is None
        target = eef.copy() if hold else target
        for _ in range(steps):
            action = np.zeros(7)
            action[:3] = np.clip((target - eef) * 12.0, -1.0, 1.0)
            action[6] = grip
            obs, _, _, _, info = env.step(action.astype(np.float32))
            actions.append(action.tolist())
            eef = obs["robot_state"]["eef_pos"]
            if info["is_success"]:
                return actions
            if not hold and np.linalg.norm(target - eef) < 0.01:
                break
    pytest.fail(f"the scripted oracle did not place {obj} in {container} ({len(actions)} steps)")


@needs_libero
@pytest.mark.slow
def test_scripted_oracle_demonstration_succeeds_when_replayed(tmp_path: Path) -> None:
    """libero_object task 0 (the alphabet soup into the basket): the oracle records a
    demonstration from scene 0; replayed through ``evaluate`` from the same scene it
    succeeds at the same step, and holding still from that scene does not."""
    import gymnasium as gym

    from longboat.embodied.eval import libero_env
    from longboat.embodied.eval.acting import ReplayPolicy
    from longboat.embodied.eval.runner import evaluate

    suite = load_suite("libero_object")
    small = dataclasses.replace(suite, env_kwargs={**suite.env_kwargs, "camera_size": 32})
    task = suite.tasks[0]
    env = gym.make(libero_env.ENV_ID, suite="libero_object", task_id=0, camera_size=32)
    try:
        obs, _ = env.reset(seed=0)
        demo = scripted_pick_and_place(env, obs, "alphabet_soup_1", "basket_1")
    finally:
        env.close()
    assert 60 < len(demo) < 300
    replayed = evaluate(small, ReplayPolicy([demo]), tmp_path / "replay", episodes=1,
                        max_steps=len(demo) + 20, seed=0, tasks=[task.name], progress=False)  # fmt: skip
    (episode,) = replayed["tasks"][0]["per_episode"]
    assert (episode["success"], episode["steps"]) == (True, len(demo))
    still = evaluate(small, HoldStill(), tmp_path / "still", episodes=1, max_steps=len(demo),
                     seed=0, tasks=[task.name], progress=False)  # fmt: skip
    assert still["total"]["successes"] == 0


if __name__ == "__main__":  # rewrite the recorded spec from the installed LIBERO
    SPEC.write_text(json.dumps(record_spec(), indent=1) + "\n")
    print(f"wrote {SPEC}")
