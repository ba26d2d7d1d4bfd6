"""The evaluation harness without a trained policy (``longboat.embodied.eval``): Wilson
intervals against hand-computed values; PushT's success signal proven by a scripted push
that succeeds at a known step, and refused to a policy that holds still; the refusals of bad
suites, tasks and policies before any environment starts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from longboat.core.config.errors import ConfigError
from longboat.embodied.cli import main
from longboat.embodied.eval.acting import Episode, ReplayPolicy
from longboat.embodied.eval.report import markdown_table
from longboat.embodied.eval.runner import check_compatible, evaluate, remap_cameras
from longboat.embodied.eval.stats import wilson_interval
from longboat.embodied.eval.suite import STATE_KEY, check_installed, load_suite, suite_names

# --- Wilson intervals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("successes", "episodes", "low", "high"),
    [
        # the roots q of (p - q)² = z² q (1 - q) / n, p = successes / episodes, z = 1.959964
        (0, 10, 0.0, 0.277533),
        (5, 10, 0.236593, 0.763407),
        (9, 10, 0.595850, 0.982124),
        (10, 10, 0.722467, 1.0),
        (1, 1, 0.206549, 1.0),
        (37, 50, 0.604468, 0.841285),
    ],
)
def test_wilson_interval_matches_hand_computed_values(
    successes: int, episodes: int, low: float, high: float
) -> None:
    got = wilson_interval(successes, episodes)
    assert got == pytest.approx((low, high), abs=1e-6)


def test_wilson_interval_edges() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes=4"):
        wilson_interval(4, 3)


# --- PushT: a scripted push succeeds, holding still does not -----------------------------------

# At the target pose (angle pi/4) the T's stem points along (-1, 1); ``reset_to_state`` with
# the block at GOAL_BLOCK puts it on the target (coverage 0.995; the environment moves the
# given position by its centre-of-gravity offset), the middle of the stem's end face then at
# STEM_END. A scene moves the block ``d`` px out along the stem and the agent 30 px behind
# the stem's end; the demonstration drives the agent 3 px a step back along the stem, which
# pushes the block straight through the target.
STEM = np.array([-1.0, 1.0]) / np.sqrt(2.0)
GOAL_BLOCK = np.array([224.0, 243.0])
STEM_END = np.array([171.0, 341.0])
SCENES = (20.0, 30.0)
SUCCESS_STEP = {20.0: 13, 30.0: 16}
"""The step at which the environment reports success, per scene (measured once)."""


def _scene(d: float) -> dict:
    block = GOAL_BLOCK + d * STEM
    agent = STEM_END + d * STEM + 30.0 * STEM
    return {"reset_to_state": [*agent.tolist(), *block.tolist(), np.pi / 4]}


def _push(d: float, steps: int = 40) -> list[list[float]]:
    agent = STEM_END + d * STEM + 30.0 * STEM
    return [(agent - 3.0 * (t + 1) * STEM).tolist() for t in range(steps)]


def _pusht_scenes() -> object:
    suite = load_suite("pusht")
    task = dataclasses.replace(suite.tasks[0], initial_states=[_scene(d) for d in SCENES])
    return dataclasses.replace(suite, tasks=[task])


class HoldStill:
    """Targets the agent's own position every step: the block never moves."""

    def begin(self, slot: int, episode: Episode) -> None:
        pass

    def act(self, slots, observations) -> np.ndarray:
        return np.stack([np.asarray(o[STATE_KEY], dtype=np.float64) for o in observations])


def _episodes(results: dict) -> list[tuple[int, bool, int]]:
    return [(e["episode"], e["success"], e["steps"]) for e in results["tasks"][0]["per_episode"]]


def test_a_scripted_push_succeeds_at_its_step_and_holding_still_never_does(tmp_path: Path) -> None:
    suite = _pusht_scenes()
    demos = [_push(d) for d in SCENES]
    runs = {
        envs: evaluate(suite, ReplayPolicy(demos), tmp_path / f"push{envs}", episodes=4,
                       num_envs=envs, max_steps=30, progress=False)
        for envs in (1, 3)
    }  # fmt: skip
    expected = [(k, True, SUCCESS_STEP[SCENES[k % 2]]) for k in range(4)]
    assert _episodes(runs[1]) == expected
    assert _episodes(runs[3]) == expected  # the same episodes on any number of environments
    forked = evaluate(suite, ReplayPolicy(demos), tmp_path / "processes", episodes=2,
                      num_envs=2, max_steps=30, processes=True, progress=False)  # fmt: skip
    assert _episodes(forked) == expected[:2]  # one process per environment (AsyncVectorEnv)
    total = runs[3]["total"]
    assert (total["episodes"], total["successes"], total["success_rate"]) == (4, 4, 1.0)
    assert total["ci95"] == pytest.approx(wilson_interval(4, 4))

    still = evaluate(suite, HoldStill(), tmp_path / "still", episodes=4, num_envs=2,
                     max_steps=30, progress=False)  # fmt: skip
    assert _episodes(still) == [(k, False, 30) for k in range(4)]
    assert still["total"]["successes"] == 0
    # the seeded random scenes of the built-in suite: holding still never succeeds either
    random = evaluate(load_suite("pusht"), HoldStill(), tmp_path / "random", episodes=3,
                      num_envs=2, max_steps=10, seed=7, progress=False)  # fmt: skip
    assert _episodes(random) == [(k, False, 10) for k in range(3)]
    assert [e["seed"] for e in random["tasks"][0]["per_episode"]] == [7, 8, 9]
    on_disk = json.loads((tmp_path / "random" / "results.json").read_text())
    assert on_disk["total"]["episodes"] == 3 and on_disk["total"]["successes"] == 0


def test_markdown_table_rows() -> None:
    results = {
        "tasks": [
            {"name": "a", "episodes": 10, "successes": 5, "success_rate": 0.5,
             "ci95": list(wilson_interval(5, 10)), "mean_steps": 12.25},
            {"name": "b", "episodes": 10, "successes": 0, "success_rate": 0.0,
             "ci95": list(wilson_interval(0, 10)), "mean_steps": 30.0},
        ],
        "total": {"name": "s", "episodes": 20, "successes": 5, "success_rate": 0.25,
                  "ci95": list(wilson_interval(5, 20)), "mean_steps": 21.125},
    }  # fmt: skip
    lines = markdown_table(results).splitlines()
    assert lines[2] == "| a | 10 | 5 | 50.0% | 23.7-76.3% | 12.2 |"
    assert lines[3] == "| b | 10 | 0 | 0.0% | 0.0-27.8% | 30.0 |"
    assert lines[4] == "| **s (suite)** | 20 | 5 | 25.0% | 11.2-46.9% | 21.1 |"


# --- refusals ---------------------------------------------------------------------------------


def test_unknown_suite_and_task_are_refused_with_exit_2(tmp_path: Path, capsys) -> None:
    assert "pusht" in suite_names()
    with pytest.raises(ConfigError) as err:
        load_suite("no_such_suite", key="--suite")
    assert err.value.keys == ["--suite"] and "pusht" in str(err.value)
    rc = main(["eval", str(tmp_path), "--suite", "no_such_suite", "--no-progress"])
    assert rc == 2
    assert "--suite='no_such_suite'" in capsys.readouterr().err
    rc = main(["eval", str(tmp_path), "--suite", "pusht", "--task", "nope", "--no-progress"])
    assert rc == 2
    assert "has no task 'nope'" in capsys.readouterr().err
    rc = main(["eval", str(tmp_path), "--suite", "pusht", "--no-progress"])  # no export there
    assert rc == 2
    assert "holds no exported policy" in capsys.readouterr().err


def test_bad_suite_files_name_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\ntasks: []\nobservation: {cameras: [x], state: []}\n"
        "action: {dim: 2, low: [0]}\nsuccess: {}\nmax_episode_steps: 0\n"
    )
    with pytest.raises(ConfigError) as err:
        load_suite(str(bad))
    text = str(err.value)
    for part in ("tasks: lists no task", "observation.cameras", "observation.state",
                 "action.low", "success.info_key", "max_episode_steps"):  # fmt: skip
        assert part in text, part
    missing = tmp_path / "missing_sim.yaml"
    missing.write_text(
        load_suite("pusht").path.read_text().replace("[gym_pusht]", "[longboat_no_such_sim]")
    )
    with pytest.raises(ConfigError, match=r"longboat_no_such_sim.*longboat-embodied\[sim\]"):
        check_installed(load_suite(str(missing)))


def test_policies_the_suite_cannot_feed_are_refused() -> None:
    suite = load_suite("pusht")
    check_compatible(suite, ["observation.images.top"], 2, 2)
    with pytest.raises(ConfigError) as err:
        check_compatible(suite, ["observation.images.front"], 6, 1)
    text = str(err.value)
    assert "['observation.images.front']" in text and "--camera" in text
    assert "state has 6 values" in text and "gives 1 action values" in text
    remapped = remap_cameras(suite, {"observation.images.front": "observation.images.top"})
    check_compatible(remapped, ["observation.images.front"], 2, 2)
    assert remapped.cameras["observation.images.front"] == "pixels"
    with pytest.raises(ConfigError, match=r"no camera 'observation\.images\.side'"):
        remap_cameras(suite, {"observation.images.front": "observation.images.side"})


def test_observation_and_action_conventions_of_a_suite() -> None:
    from gymnasium.spaces import Box

    from longboat.embodied.eval.rollout import ObservationMap

    base = load_suite("pusht")
    suite = dataclasses.replace(
        base,
        cameras={"observation.images.top": "pixels/top"},
        state=["agent_pos", "extra"],
        state_scale=[2.0, 2.0, 1.0],
        state_offset=[1.0, 1.0, 0.0],
        action_low=None,
        action_high=None,
        action_scale=[0.5, 2.0],
        action_offset=[10.0, 0.0],
    )
    frames = np.arange(2 * 4 * 6 * 3, dtype=np.uint8).reshape(2, 4, 6, 3)
    obs = {
        "pixels": {"top": frames},
        "agent_pos": np.array([[1.0, 2.0], [3.0, 4.0]]),
        "extra": np.array([[5.0], [6.0]]),
    }
    conventions = ObservationMap(suite, base.tasks[0], Box(0.0, 100.0, shape=(2,)))
    second = conventions.policy_observation(obs, 1)
    np.testing.assert_array_equal(second[STATE_KEY], [7.0, 9.0, 6.0])
    np.testing.assert_array_equal(second["observation.images.top"], frames[1])
    assert second["task"] == base.tasks[0].instruction
    # policy units -> environment: x * scale + offset, clipped to the action space (a third
    # value of a wider policy is dropped)
    env = conventions.env_actions(np.array([[4.0, 30.0, 9.0], [-40.0, 70.0, 9.0]]))
    np.testing.assert_array_equal(env, [[12.0, 60.0], [0.0, 100.0]])
    with pytest.raises(KeyError, match="'pixels/side'"):
        ObservationMap(dataclasses.replace(suite, cameras={"x": "pixels/side"}), base.tasks[0],
                       Box(0.0, 1.0, shape=(2,))).policy_observation(obs, 0)  # fmt: skip
