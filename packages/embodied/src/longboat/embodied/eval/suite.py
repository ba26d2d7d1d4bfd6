"""Evaluation suites as data: ``load_suite(name_or_path)`` -> ``SuiteSpec``.

A suite is one YAML file (the built-in ones in ``eval/suites/``, or any path) that says how a
family of gymnasium environments meets a policy, with no code of its own:

- ``tasks``: the environments (``env_id``, per-task ``env_kwargs``, the ``instruction`` given
  to the policy as its task text, optional ``initial_states``: reset options of each episode,
  used in turn, for suites with fixed initial scenes);
- ``observation``: which observation entry feeds which policy feature (``cameras``: policy
  camera key -> observation key, ``a/b`` for the entry ``b`` of a nested mapping ``a``;
  ``state``: observation keys concatenated into
  ``observation.state``, with an optional affine ``state_scale`` / ``state_offset`` into the
  units the policy was trained in);
- ``action``: its width, the bounds actions are clipped to (``clip: false``: none) and an
  optional affine map from the policy's units (``scale`` / ``offset``);
- ``success``: the ``info`` key that says an episode succeeded (once true, the episode ends);
- ``max_episode_steps``, ``fps`` (of the videos) and ``video.source`` (``render``: the
  environment's ``render()``; else an observation key);
- ``requires``: modules imported before ``gymnasium.make`` (they register the environments);
  ``env_vars``: environment variables set first where unset (``MUJOCO_GL: egl``);
  ``install``: what installs them (default ``longboat-embodied[sim]``).

Every key is checked when the file is read; a problem is a ``ConfigError`` naming the file,
the key and the fix.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from longboat.core.config.errors import ConfigError, ConfigProblem

SUITES_DIR = Path(__file__).with_name("suites")
"""The built-in suites (``<name>.yaml``)."""
STATE_KEY = "observation.state"
SIM_EXTRA = "longboat-embodied[sim]"
"""What installs a suite's simulator unless its ``install`` says otherwise."""


@dataclass(frozen=True)
class TaskSpec:
    """One task of a suite: an environment and the text the policy is given."""

    name: str
    """The task's name in the results."""
    env_id: str
    """The gymnasium id ``gymnasium.make`` builds."""
    instruction: str = ""
    """The task text (the policy's ``task``)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``gymnasium.make`` (over the suite's ``env_kwargs``)."""
    initial_states: list[dict[str, Any]] = field(default_factory=list)
    """Reset options of the episodes, episode ``k`` taking entry ``k mod len``; empty: the
    environment's seeded random reset."""


@dataclass(frozen=True)
class SuiteSpec:
    """A suite read from its YAML file (module doc)."""

    name: str
    path: Path
    tasks: list[TaskSpec]
    cameras: dict[str, str]
    """Policy camera key -> observation key."""
    state: list[str]
    """Observation keys concatenated into ``observation.state``."""
    action_dim: int
    max_episode_steps: int
    success_key: str
    fps: int = 10
    description: str = ""
    requires: list[str] = field(default_factory=list)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    state_scale: list[float] | None = None
    state_offset: list[float] | None = None
    action_low: list[float] | None = None
    action_high: list[float] | None = None
    action_scale: list[float] | None = None
    action_offset: list[float] | None = None
    video_source: str = "render"
    install: str = SIM_EXTRA
    """What installs the simulator (``install``), named when it is missing."""
    action_clip: bool = True
    """Clip actions to ``action.low`` / ``action.high`` (default: the action space's bounds)."""
    env_vars: dict[str, str] = field(default_factory=dict)
    """Environment variables set (where unset) before ``requires`` are imported, e.g.
    ``MUJOCO_GL: egl`` for headless MuJoCo rendering."""
    state_dim: int | None = None
    """Width of ``observation.state`` (``observation.state_dim``), checked against a policy
    before any environment starts; None: not checked."""

    @property
    def state_width(self) -> int | None:
        """The state width a policy must read (None: not declared)."""
        return self.state_dim

    def task(self, name: str) -> TaskSpec:
        """The task called ``name``."""
        for task in self.tasks:
            if task.name == name:
                return task
        raise ConfigError(
            f"suite {self.name} has no task {name!r}",
            key="--task",
            value=name,
            fix=f"use one of {', '.join(t.name for t in self.tasks)}",
        )


def suite_names() -> list[str]:
    """The built-in suites."""
    return sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))


def suite_path(name_or_path: str, key: str = "suite") -> Path:
    """The YAML file of a built-in suite name or a path; a ``ConfigError`` for neither."""
    given = Path(name_or_path)
    if given.suffix in (".yaml", ".yml") and given.is_file():
        return given
    builtin = SUITES_DIR / f"{name_or_path}.yaml"
    if builtin.is_file():
        return builtin
    raise ConfigError(
        "is neither a built-in suite nor a suite YAML file",
        key=key,
        value=name_or_path,
        fix=f"use one of {', '.join(suite_names())}, or the path of a suite .yaml",
    )


def missing_modules(suite: SuiteSpec) -> list[str]:
    """The suite's ``requires`` (and gymnasium) that are not installed."""
    names = ["gymnasium", *suite.requires]
    return [n for n in names if importlib.util.find_spec(n) is None]


def check_installed(suite: SuiteSpec, key: str = "suite") -> None:
    """A ``ConfigError`` when the suite's simulator is not installed."""
    missing = missing_modules(suite)
    if missing:
        raise ConfigError(
            f"suite {suite.name} needs {', '.join(missing)}, which is not installed",
            key=key,
            value=suite.name,
            fix=f"install the simulator: pip install '{suite.install}'",
        )


def load_suite(name_or_path: str, key: str = "suite") -> SuiteSpec:
    """Read and check a suite (a built-in name or a YAML path); ``key`` names the setting
    that chose it in errors."""
    path = suite_path(name_or_path, key)
    try:
        body = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}", key=key, value=name_or_path) from None
    if not isinstance(body, dict):
        raise ConfigError(f"{path} holds no mapping", key=key, value=name_or_path)
    return _parse(body, path)


def _parse(body: dict[str, Any], path: Path) -> SuiteSpec:
    problems: list[ConfigProblem] = []

    def need(where: dict[str, Any], name: str, kind: type | tuple[type, ...], dotted: str) -> Any:
        value = where.get(name) if isinstance(where, dict) else None
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            problems.append(
                ConfigProblem(f"{path}: {dotted}", f"is required ({_kind(kind)})", value=value)
            )
            return None
        return value

    name = need(body, "name", str, "name")
    raw_tasks = need(body, "tasks", list, "tasks") or []
    tasks = []
    for i, t in enumerate(raw_tasks):
        if not isinstance(t, dict):
            problems.append(ConfigProblem(f"{path}: tasks[{i}]", "must be a mapping", value=t))
            continue
        tname = need(t, "name", str, f"tasks[{i}].name")
        env_id = need(t, "env_id", str, f"tasks[{i}].env_id")
        states = t.get("initial_states") or []
        if not isinstance(states, list) or not all(isinstance(s, dict) for s in states):
            problems.append(
                ConfigProblem(
                    f"{path}: tasks[{i}].initial_states",
                    "must be a list of reset-option mappings",
                    value=states,
                )
            )
            states = []
        if tname and env_id:
            tasks.append(
                TaskSpec(
                    name=tname,
                    env_id=env_id,
                    instruction=str(t.get("instruction", "")),
                    env_kwargs=dict(t.get("env_kwargs") or {}),
                    initial_states=list(states),
                )
            )
    if not raw_tasks:
        problems.append(ConfigProblem(f"{path}: tasks", "lists no task"))
    observation = need(body, "observation", dict, "observation") or {}
    cameras = observation.get("cameras") or {}
    if not isinstance(cameras, dict):
        problems.append(
            ConfigProblem(
                f"{path}: observation.cameras",
                "must map policy camera keys to observation keys",
                value=cameras,
                fix="e.g. {observation.images.top: pixels}",
            )
        )
        cameras = {}
    state = observation.get("state") or []
    state = [state] if isinstance(state, str) else state
    if not state or not all(isinstance(s, str) for s in state):
        problems.append(
            ConfigProblem(
                f"{path}: observation.state",
                "must list the observation keys of the robot state",
                value=state,
                fix="e.g. [agent_pos]",
            )
        )
    action = need(body, "action", dict, "action")
    action_dim = need(action, "dim", int, "action.dim") if action is not None else None
    action = action or {}
    success = need(body, "success", dict, "success")
    success_key = None
    if success is not None:
        success_key = need(success, "info_key", str, "success.info_key")
    steps = need(body, "max_episode_steps", int, "max_episode_steps")
    if isinstance(steps, int) and steps < 1:
        problems.append(ConfigProblem(f"{path}: max_episode_steps", "must be >= 1", value=steps))
    state_dim = observation.get("state_dim")
    if state_dim is not None and (
        isinstance(state_dim, bool) or not isinstance(state_dim, int) or state_dim < 1
    ):
        problems.append(
            ConfigProblem(
                f"{path}: observation.state_dim", "must be an integer >= 1", value=state_dim
            )
        )
    vectors = {
        "observation.state_scale": observation.get("state_scale"),
        "observation.state_offset": observation.get("state_offset"),
        "action.low": action.get("low"),
        "action.high": action.get("high"),
        "action.scale": action.get("scale"),
        "action.offset": action.get("offset"),
    }
    for key, value in vectors.items():
        if value is not None and not (
            isinstance(value, list) and all(isinstance(v, int | float) for v in value)
        ):
            problems.append(
                ConfigProblem(f"{path}: {key}", "must be a list of numbers", value=value)
            )
        elif key.startswith("action.") and value is not None and len(value) != action_dim:
            problems.append(
                ConfigProblem(
                    f"{path}: {key}", f"must have action.dim={action_dim} values", value=value
                )
            )
    if problems:
        raise ConfigError(problems)
    video = body.get("video") or {}
    return SuiteSpec(
        name=name,
        path=path,
        tasks=tasks,
        cameras={str(k): str(v) for k, v in cameras.items()},
        state=list(state),
        action_dim=action_dim,
        max_episode_steps=steps,
        success_key=success_key,
        fps=int(body.get("fps", 10)),
        description=str(body.get("description", "")),
        requires=[str(r) for r in body.get("requires") or []],
        env_kwargs=dict(body.get("env_kwargs") or {}),
        state_scale=vectors["observation.state_scale"],
        state_offset=vectors["observation.state_offset"],
        action_low=vectors["action.low"],
        action_high=vectors["action.high"],
        action_scale=vectors["action.scale"],
        action_offset=vectors["action.offset"],
        video_source=str(video.get("source", "render")),
        state_dim=state_dim,
        action_clip=bool(action.get("clip", True)),
        install=str(body.get("install", SIM_EXTRA)),
        env_vars={str(k): str(v) for k, v in (body.get("env_vars") or {}).items()},
    )


def _kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    words = {str: "a string", int: "an integer", list: "a list", dict: "a mapping"}
    return " or ".join(words.get(k, k.__name__) for k in kinds)


__all__ = [
    "SUITES_DIR",
    "SuiteSpec",
    "TaskSpec",
    "check_installed",
    "load_suite",
    "missing_modules",
    "suite_names",
    "suite_path",
]
