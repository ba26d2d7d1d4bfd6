"""LIBERO's tasks as gymnasium environments: ``longboat/Libero-v0`` (importing this module
registers it; the ``libero_*`` suites list it in ``requires``).

LIBERO (robosuite + MuJoCo, a Franka Panda arm under an operational-space controller) comes
without the gymnasium API; this adapter gives it, and nothing else: which entries feed the
policy, and in which units, is the suite YAML's. One environment is one task of one LIBERO
suite (``suite``: ``libero_spatial``, ``libero_object``, ``libero_goal``, ``libero_10``, ...;
``task_id``: its index in the suite's order):

- ``reset(seed=s)`` puts the scene in the task's fixed evaluation state ``s mod N`` (LIBERO
  ships N = 50 per task; ``options={"init_state": i}`` picks one), then lets the objects
  settle for ``settle_steps`` steps of an open, motionless gripper, as LIBERO's evaluation
  does;
- observations: ``pixels/agentview`` and ``pixels/wrist`` (``camera_size`` square, uint8,
  turned 180° by default: robosuite renders upside down, LeRobot's LIBERO datasets do not),
  ``robot_state/eef_pos`` (3), ``robot_state/eef_axis_angle`` (3, the end effector's
  orientation as an axis times its angle, ``quat_to_axis_angle``), ``robot_state/gripper_qpos`` (2),
  ``robot_state/joint_pos`` (7);
- actions: 7 values in [-1, 1], a delta of the end effector's position and orientation and
  the gripper (-1 open, 1 closed);
- ``info["is_success"]``: the task's goal predicates (the BDDL file's) hold; the episode then
  terminates. ``render()`` is the agent-view frame.

The simulator renders off screen through ``MUJOCO_GL`` (the suites set ``egl``; mesa's
software EGL where there is no GPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

ENV_ID = "longboat/Libero-v0"
"""The gymnasium id of a LIBERO task."""
OPEN_GRIPPER = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0])
"""The settling action: no motion, gripper open."""
STATE_WIDTHS = {"eef_pos": 3, "eef_axis_angle": 3, "gripper_qpos": 2, "joint_pos": 7}
"""The ``robot_state`` entries and their widths."""


def quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """The rotation of a unit quaternion ``(x, y, z, w)`` as its axis times its angle
    (radians, ``2 acos(w)`` in [0, 2 pi]); zero for the identity. ``q`` and ``-q`` are not
    folded onto one angle: LIBERO's resting gripper points down (a half turn, ``w`` near 0),
    where folding would flip the state's sign as ``w`` crosses 0; LeRobot's LIBERO datasets
    do not fold either."""
    q = np.asarray(quat, dtype=np.float64)
    w = float(np.clip(q[3], -1.0, 1.0))
    sin_half = np.sqrt(max(1.0 - w * w, 0.0))
    if sin_half < 1e-9:
        return np.zeros(3)
    return q[:3] / sin_half * (2.0 * np.arccos(w))


def libero_assets_missing() -> str | None:
    """Why the installed LIBERO cannot build its scenes (None: it can): the releases that
    download their scene assets on first use have none until then."""
    from libero.libero import get_libero_path

    try:
        assets = Path(get_libero_path("assets"))
    except (AssertionError, KeyError, OSError):
        assets = None
    if assets is None or not (assets / "scenes").is_dir():
        return (
            f"LIBERO's scene assets are not installed ({assets}/scenes is missing): install "
            "longboat-embodied[libero], whose LIBERO ships them"
        )
    return None


class LiberoEnv(gym.Env):
    """One LIBERO task as a gymnasium environment (module doc)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(
        self,
        suite: str,
        task_id: int,
        *,
        camera_size: int = 256,
        settle_steps: int = 10,
        flip_images: bool = True,
        render_mode: str | None = "rgb_array",
    ) -> None:
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        why = libero_assets_missing()
        if why is not None:
            raise RuntimeError(why)
        suites = benchmark.get_benchmark_dict()
        if suite not in suites:
            raise ValueError(f"LIBERO has no suite {suite!r}; it has {sorted(suites)}")
        self.benchmark = suites[suite]()
        if not 0 <= task_id < self.benchmark.n_tasks:
            raise ValueError(f"{suite} has tasks 0..{self.benchmark.n_tasks - 1}, not {task_id}")
        task = self.benchmark.get_task(task_id)
        self.instruction = task.language
        self.init_states = self.benchmark.get_task_init_states(task_id)
        bddl = Path(get_libero_path("bddl_files")) / task.problem_folder / task.bddl_file
        self.sim = OffScreenRenderEnv(
            bddl_file_name=str(bddl),
            camera_heights=camera_size,
            camera_widths=camera_size,
            hard_reset=False,  # the scene is set from a stored state at every reset
        )
        self.settle_steps = int(settle_steps)
        self.flip_images = bool(flip_images)
        self.render_mode = render_mode
        image = gym.spaces.Box(0, 255, (camera_size, camera_size, 3), np.uint8)
        self.observation_space = gym.spaces.Dict(
            {
                "pixels": gym.spaces.Dict({"agentview": image, "wrist": image}),
                "robot_state": gym.spaces.Dict(
                    {
                        k: gym.spaces.Box(-np.inf, np.inf, (n,), np.float64)
                        for k, n in STATE_WIDTHS.items()
                    }
                ),
            }
        )
        self.action_space = gym.spaces.Box(-1.0, 1.0, (7,), np.float32)
        self._last: dict[str, Any] | None = None

    def _image(self, frame: np.ndarray) -> np.ndarray:
        frame = np.asarray(frame, dtype=np.uint8)
        return np.ascontiguousarray(frame[::-1, ::-1] if self.flip_images else frame)

    def _observation(self, raw: dict[str, Any]) -> dict[str, Any]:
        self._last = raw
        return {
            "pixels": {
                "agentview": self._image(raw["agentview_image"]),
                "wrist": self._image(raw["robot0_eye_in_hand_image"]),
            },
            "robot_state": {
                "eef_pos": np.asarray(raw["robot0_eef_pos"], dtype=np.float64),
                "eef_axis_angle": quat_to_axis_angle(raw["robot0_eef_quat"]),
                "gripper_qpos": np.asarray(raw["robot0_gripper_qpos"], dtype=np.float64),
                "joint_pos": np.asarray(raw["robot0_joint_pos"], dtype=np.float64),
            },
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        options = options or {}
        index = options.get("init_state", 0 if seed is None else seed)
        state = self.init_states[int(index) % len(self.init_states)]
        if seed is not None:
            self.sim.seed(int(seed))
        self.sim.reset()
        raw = self.sim.set_init_state(state)
        for _ in range(self.settle_steps):
            raw, _, _, _ = self.sim.step(OPEN_GRIPPER)
        return self._observation(raw), {"is_success": False, "init_state": int(index)}

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict]:
        raw, reward, done, _ = self.sim.step(np.asarray(action, dtype=np.float64))
        success = bool(self.sim.check_success())
        truncated = bool(done) and not success  # the simulator's own horizon
        return self._observation(raw), float(reward), success, truncated, {"is_success": success}

    def object_positions(self) -> dict[str, np.ndarray]:
        """The scene's objects and their positions (world frame, metres) at the last
        observation, e.g. ``{"alphabet_soup_1": ..., "basket_1": ...}``: what a scripted
        oracle steers by (the policy never sees them)."""
        raw = self._last or {}
        return {
            key[: -len("_pos")]: np.asarray(value, dtype=np.float64)
            for key, value in raw.items()
            if key.endswith("_pos") and not key.startswith("robot") and "_to_" not in key
        }

    def render(self) -> np.ndarray | None:
        if self._last is None:
            return None
        return self._image(self._last["agentview_image"])

    def close(self) -> None:
        sim = getattr(self, "sim", None)
        if sim is not None:
            sim.close()
            self.sim = None


if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point=f"{__name__}:LiberoEnv", disable_env_checker=True)

__all__ = ["ENV_ID", "LiberoEnv", "libero_assets_missing", "quat_to_axis_angle"]
