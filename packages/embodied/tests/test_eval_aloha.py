"""The MuJoCo suite ``aloha`` (``longboat-embodied[aloha]``): both tasks roll out headless
(MuJoCo through EGL), holding the joints still never succeeds, and a recorded episode's
video has the reset frame and one frame per step of the top camera. Slow: MuJoCo renders
480x640 frames in software on a CPU."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from longboat.embodied.eval.runner import evaluate
from longboat.embodied.eval.suite import STATE_KEY, load_suite

pytest.importorskip("gym_aloha")
pytestmark = pytest.mark.slow


class HoldJoints:
    """Targets the current joint positions every step."""

    def begin(self, slot, episode) -> None:
        pass

    def act(self, slots, observations) -> np.ndarray:
        return np.stack([np.asarray(o[STATE_KEY], dtype=np.float64) for o in observations])


def test_aloha_tasks_roll_out_headless_with_video(tmp_path: Path) -> None:
    suite = load_suite("aloha")
    assert [t.name for t in suite.tasks] == ["transfer_cube", "insertion"]
    results = evaluate(suite, HoldJoints(), tmp_path, episodes=2, num_envs=2, max_steps=4,
                       videos=1, seed=5, progress=False)  # fmt: skip
    for task in results["tasks"]:
        steps = [(e["seed"], e["success"], e["steps"]) for e in task["per_episode"]]
        assert steps == [(5, False, 4), (6, False, 4)], task["name"]
    assert results["total"]["episodes"] == 4 and results["total"]["successes"] == 0
    assert "| **aloha (suite)** | 4 | 0 | 0.0% |" in (tmp_path / "results.md").read_text()
    assert results["videos"] == ["videos/transfer_cube_ep000.mp4", "videos/insertion_ep000.mp4"]
    with av.open(str(tmp_path / "videos" / "insertion_ep000.mp4")) as video:
        frames = [f.to_ndarray(format="rgb24") for f in video.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (480, 640, 3)
    assert frames[0].std() > 10  # a rendered scene, not a blank frame
