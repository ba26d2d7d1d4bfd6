"""Closed-loop rollouts of one task: ``run_task`` -> one ``EpisodeResult`` per episode.

Episodes run batched across a gymnasium vector of environments (``SyncVectorEnv`` in this
process, or ``AsyncVectorEnv``: one process per environment, started from a fork server, and
the policy batched over them), with autoreset off: when an
environment's episode ends (success, the environment's termination or truncation, or
``max_steps``) the next episode of the task starts in it, reset with that episode's seed
(``seed + k`` for episode ``k``) and its initial state when the suite lists some. An
environment with no episode left keeps stepping (its last action) until the others finish;
nothing it does is counted. Episode ``k`` thus sees the same scene and the same policy noise
whatever the number of environments.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from longboat.embodied.eval.acting import ActingPolicy, Episode
from longboat.embodied.eval.suite import STATE_KEY, SuiteSpec, TaskSpec


@dataclass
class EpisodeResult:
    """The outcome of one episode."""

    task: str
    episode: int
    seed: int
    success: bool
    steps: int
    """Environment steps taken (up to and including the one that succeeded)."""
    reward: float
    """Sum of the environment's rewards."""
    frames: list[np.ndarray] = field(default_factory=list, repr=False)
    """The video frames (uint8 [H, W, 3]) of a recorded episode; empty otherwise."""


def make_env(
    env_id: str,
    kwargs: dict[str, Any],
    requires: Sequence[str],
    env_vars: dict[str, str] | None = None,
) -> Any:
    """One environment (sets ``env_vars`` where unset and imports the modules that register
    it first)."""
    import os

    for name, value in (env_vars or {}).items():
        os.environ.setdefault(name, value)
    import gymnasium as gym

    for module in requires:
        importlib.import_module(module)
    return gym.make(env_id, **kwargs)


def make_vector(suite: SuiteSpec, task: TaskSpec, num_envs: int, *, processes: bool = False) -> Any:
    """The task's vector of ``num_envs`` environments, autoreset off."""
    import gymnasium as gym

    kwargs = {**suite.env_kwargs, **task.env_kwargs}
    fn = functools.partial(
        make_env, task.env_id, kwargs, tuple(suite.requires), dict(suite.env_vars)
    )
    mode = gym.vector.AutoresetMode.DISABLED
    if processes:  # forkserver: a clean parent for the workers (this one runs torch threads)
        return gym.vector.AsyncVectorEnv([fn] * num_envs, autoreset_mode=mode, context="forkserver")
    return gym.vector.SyncVectorEnv([fn] * num_envs, autoreset_mode=mode)


def _entry(obs: Any, key: str, slot: int) -> np.ndarray:
    """Environment ``slot``'s value of ``key`` in a vector observation; ``a/b`` reads the
    entry ``b`` of the nested mapping ``a`` (e.g. ``pixels/top``)."""
    value = obs
    for part in key.split("/"):
        if not isinstance(value, dict):
            return np.asarray(value[slot])  # a plain array observation: its only entry
        if part not in value:
            raise KeyError(
                f"the environment's observation has no {key!r} ({part!r} missing; it has "
                f"{sorted(value)})"
            )
        value = value[part]
    return np.asarray(value[slot])


class ObservationMap:
    """A suite's observation and action conventions, applied per environment."""

    def __init__(self, suite: SuiteSpec, task: TaskSpec, action_space: Any) -> None:
        self.suite = suite
        self.instruction = task.instruction
        dim = suite.action_dim
        low = suite.action_low if suite.action_low is not None else _bound(action_space, "low")
        high = suite.action_high if suite.action_high is not None else _bound(action_space, "high")
        if not suite.action_clip:
            low = high = None
        self.low = None if low is None else np.asarray(low, dtype=np.float64)[:dim]
        self.high = None if high is None else np.asarray(high, dtype=np.float64)[:dim]
        self.action_scale = np.asarray(suite.action_scale or [1.0] * dim, dtype=np.float64)
        self.action_offset = np.asarray(suite.action_offset or [0.0] * dim, dtype=np.float64)

    def policy_observation(self, obs: Any, slot: int) -> dict[str, Any]:
        """The policy's observation of environment ``slot`` (cameras, state, task)."""
        s = self.suite
        state = np.concatenate([_entry(obs, k, slot).reshape(-1) for k in s.state])
        state = state.astype(np.float64)
        if s.state_scale is not None:
            state = state * np.asarray(s.state_scale, dtype=np.float64)
        if s.state_offset is not None:
            state = state + np.asarray(s.state_offset, dtype=np.float64)
        out: dict[str, Any] = {STATE_KEY: state, "task": self.instruction}
        for camera, key in s.cameras.items():
            out[camera] = _entry(obs, key, slot)
        return out

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """Policy actions ``[N, >= dim]`` -> the environment's ``[N, dim]`` (affine, clipped)."""
        actions = np.asarray(actions, dtype=np.float64)
        if actions.shape[-1] < self.suite.action_dim:
            raise ValueError(
                f"the policy gives {actions.shape[-1]} action values; suite "
                f"{self.suite.name} needs action.dim={self.suite.action_dim}"
            )
        out = actions[:, : self.suite.action_dim] * self.action_scale + self.action_offset
        if self.low is not None and self.high is not None:
            out = np.clip(out, self.low, self.high)
        return out


def _bound(space: Any, name: str) -> np.ndarray | None:
    value = getattr(space, name, None)
    return None if value is None else np.asarray(value, dtype=np.float64).reshape(-1)


def _flag(infos: dict[str, Any], key: str, slot: int) -> bool:
    if key not in infos:
        return False
    mask = infos.get(f"_{key}")
    if mask is not None and not bool(mask[slot]):
        return False
    return bool(infos[key][slot])


def run_task(
    suite: SuiteSpec,
    task: TaskSpec,
    policy: ActingPolicy,
    *,
    episodes: int,
    num_envs: int,
    seed: int,
    max_steps: int | None = None,
    record: int = 0,
    processes: bool = False,
    on_episode: Callable[[EpisodeResult], None] | None = None,
) -> list[EpisodeResult]:
    """Roll ``policy`` out for ``episodes`` episodes of ``task`` (module doc); the first
    ``record`` episodes keep their video frames. ``on_episode`` is called as each ends."""
    if episodes < 1 or num_envs < 1:
        raise ValueError(f"episodes={episodes} and num_envs={num_envs} must be >= 1")
    limit = suite.max_episode_steps if max_steps is None else int(max_steps)
    n = min(num_envs, episodes)
    envs = make_vector(suite, task, n, processes=processes)
    try:
        conventions = ObservationMap(suite, task, envs.single_action_space)
        return _episodes(
            envs, suite, task, policy, conventions, episodes, n, seed, limit, record, on_episode
        )
    finally:
        envs.close()


def _episodes(
    envs: Any,
    suite: SuiteSpec,
    task: TaskSpec,
    policy: ActingPolicy,
    conventions: ObservationMap,
    episodes: int,
    n: int,
    seed: int,
    limit: int,
    record: int,
    on_episode: Callable[[EpisodeResult], None] | None,
) -> list[EpisodeResult]:
    render = suite.video_source == "render"
    running: list[EpisodeResult | None] = [None] * n
    results: list[EpisodeResult] = []
    next_episode = 0
    last_actions = np.zeros((n, suite.action_dim))
    obs: Any = None

    def start(slot: int, k: int) -> Any:
        options = task.initial_states[k % len(task.initial_states)] if task.initial_states else None
        mask = np.zeros(n, dtype=np.bool_)
        mask[slot] = True
        seeds: list[int | None] = [None] * n
        seeds[slot] = seed + k
        reset_options = {"reset_mask": mask, **(dict(options) if options else {})}
        new_obs, _ = envs.reset(seed=seeds, options=reset_options)
        running[slot] = EpisodeResult(task.name, k, seed + k, False, 0, 0.0)
        policy.begin(slot, Episode(task.name, k, seed + k))
        return new_obs

    # Every environment needs one reset before a masked reset can touch one of them.
    obs, _ = envs.reset(seed=[seed + k for k in range(n)])
    for slot in range(n):
        obs = start(slot, next_episode)
        next_episode += 1
    frames_due = record > 0
    if frames_due:
        _record(envs, obs, running, record, render, suite)
    while any(r is not None for r in running):
        active = [s for s in range(n) if running[s] is not None]
        observations = [conventions.policy_observation(obs, s) for s in active]
        actions = last_actions.copy()
        actions[active] = conventions.env_actions(policy.act(active, observations))
        last_actions = actions
        obs, rewards, terminated, truncated, infos = envs.step(actions.astype(np.float32))
        ended = []
        for s in active:
            r = running[s]
            assert r is not None
            r.steps += 1
            r.reward += float(rewards[s])
            r.success = r.success or _flag(infos, suite.success_key, s)
            if r.success or terminated[s] or truncated[s] or r.steps >= limit:
                ended.append(s)
        if frames_due:
            _record(envs, obs, running, record, render, suite)
        for s in ended:
            r = running[s]
            assert r is not None
            results.append(r)
            if on_episode is not None:
                on_episode(r)
            running[s] = None
            if next_episode < episodes:
                obs = start(s, next_episode)
                next_episode += 1
                if frames_due:
                    _record(envs, obs, running, record, render, suite, only=s)
            else:  # idle: reset so that the vector can keep stepping the others
                obs = _idle_reset(envs, s, n, seed)
        for s in range(n):  # an idle environment that ended by itself (no autoreset)
            if s not in active and (terminated[s] or truncated[s]):
                obs = _idle_reset(envs, s, n, seed)
        frames_due = any(r is not None and r.episode < record for r in running)
    return sorted(results, key=lambda r: r.episode)


def _idle_reset(envs: Any, slot: int, n: int, seed: int) -> Any:
    mask = np.zeros(n, dtype=np.bool_)
    mask[slot] = True
    seeds: list[int | None] = [None] * n
    seeds[slot] = seed
    new_obs, _ = envs.reset(seed=seeds, options={"reset_mask": mask})
    return new_obs


def _record(
    envs: Any,
    obs: Any,
    running: list[EpisodeResult | None],
    record: int,
    render: bool,
    suite: SuiteSpec,
    only: int | None = None,
) -> None:
    slots = [
        s
        for s, r in enumerate(running)
        if r is not None and r.episode < record and (only is None or s == only)
    ]
    if not slots:
        return
    frames = envs.render() if render else None
    for s in slots:
        r = running[s]
        assert r is not None
        frame = frames[s] if frames is not None else _entry(obs, suite.video_source, s)
        r.frames.append(np.ascontiguousarray(np.asarray(frame, dtype=np.uint8)))


__all__ = ["EpisodeResult", "ObservationMap", "make_env", "make_vector", "run_task"]
