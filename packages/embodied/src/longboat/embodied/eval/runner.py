"""One evaluation of a trained policy on a suite: ``evaluate(...)`` -> the results dict
(written to ``results.json`` / ``results.md``, the videos under ``videos/``).

``load_acting_policy`` reads an export folder (native, ``export/lerobot`` or
``export/isaac``) or a run directory (its ``export/``) through
``longboat.embodied.inference.load_policy``, or a run's native checkpoint
(``checkpoint=PATH``, ``eval.checkpoint``); ``check_compatible`` refuses, before any
environment starts, a policy whose cameras, state or action width the suite cannot feed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError, ConfigProblem
from longboat.embodied.eval.acting import ActingPolicy, TrainedPolicy
from longboat.embodied.eval.report import build_results, write_results, write_videos
from longboat.embodied.eval.rollout import EpisodeResult, run_task
from longboat.embodied.eval.suite import SuiteSpec, check_installed

PROCESSOR_FILE = "processor.json"


def policy_dir(path: str | Path, key: str = "policy") -> Path:
    """The export folder of ``path``: itself when it holds ``processor.json``, else its
    ``export/`` (a run directory)."""
    root = Path(path)
    for candidate in (root, root / "export"):
        if (candidate / PROCESSOR_FILE).is_file():
            return candidate
    raise ConfigError(
        f"{root} holds no exported policy ({PROCESSOR_FILE} in it or in its export/)",
        key=key,
        value=str(path),
        fix="give a run's export folder (<output_dir>/export, or its lerobot/ or isaac/ "
        "folder), the run directory, or a native checkpoint as checkpoint=PATH",
    )


def remap_cameras(suite: SuiteSpec, remap: Mapping[str, str]) -> SuiteSpec:
    """The suite with policy camera ``k`` fed by the suite camera ``remap[k]``."""
    if not remap:
        return suite
    cameras = dict(suite.cameras)
    for policy_key, suite_key in remap.items():
        if suite_key not in suite.cameras:
            raise ConfigError(
                f"suite {suite.name} has no camera {suite_key!r}",
                key="--camera",
                value=f"{policy_key}={suite_key}",
                fix=f"map onto one of {', '.join(suite.cameras)}",
            )
        cameras[policy_key] = suite.cameras[suite_key]
    return dataclasses.replace(suite, cameras=cameras)


def check_compatible(
    suite: SuiteSpec, cameras: Sequence[str], state_dim: int | None, action_dim: int | None
) -> None:
    """A ``ConfigError`` when the suite cannot feed a policy with these cameras and state
    width, or the policy gives fewer action values than the suite needs; None widths are
    not checked."""
    problems = []
    missing = [c for c in cameras if c not in suite.cameras]
    if missing:
        problems.append(
            ConfigProblem(
                "--camera",
                f"the policy reads camera(s) {missing}, which suite {suite.name} does not "
                f"give (it gives {sorted(suite.cameras)})",
                fix="map each policy camera onto a suite camera with --camera "
                "POLICY_KEY=SUITE_KEY, or train with the suite's camera names",
            )
        )
    width = suite.state_width
    if state_dim is not None and width is not None and state_dim != width:
        problems.append(
            ConfigProblem(
                "suite",
                f"the policy's state has {state_dim} values; suite {suite.name} gives "
                f"{width} ({' + '.join(suite.state)})",
                value=suite.name,
                fix="evaluate on a suite of the embodiment the policy was trained on",
            )
        )
    if action_dim is not None and action_dim < suite.action_dim:
        problems.append(
            ConfigProblem(
                "suite",
                f"the policy gives {action_dim} action values; suite {suite.name} needs "
                f"{suite.action_dim}",
                value=suite.name,
                fix="evaluate on a suite of the embodiment the policy was trained on",
            )
        )
    if problems:
        raise ConfigError(problems)


def _holds_checkpoint(path: str | Path) -> bool:
    from longboat.embodied.eval.checkpoint import resolve_checkpoint

    try:
        resolve_checkpoint(path)
    except ConfigError:
        return False
    return True


def load_acting_policy(
    path: str | Path, suite: SuiteSpec, *, device: str = "cpu", n_action_steps: int | None = None
) -> TrainedPolicy:
    """The policy ``path`` names, checked against ``suite``: ``checkpoint=PATH`` a run's
    native checkpoint (``eval.checkpoint``: a step folder, a ``checkpoint.dir`` or a run
    directory); else an export folder (``policy_dir``), or a native checkpoint where the
    path holds no export (a step folder, or a run that wrote none yet)."""
    from longboat.embodied.eval.checkpoint import CHECKPOINT_KEY, checkpoint_policy
    from longboat.embodied.inference.processor import PolicyProcessor

    text = str(path)
    native = text.startswith(f"{CHECKPOINT_KEY}=")
    if native:
        path = text[len(CHECKPOINT_KEY) + 1 :]
        if not path:
            raise ConfigError(
                "names no folder",
                key=CHECKPOINT_KEY,
                value="",
                fix="checkpoint=<run directory or step_XXXXXXXX folder>",
            )
    else:
        try:
            root = policy_dir(path)
        except ConfigError:
            if not _holds_checkpoint(path):
                raise
            native = True
    if native:
        policy = checkpoint_policy(path, suite, device=device, n_action_steps=n_action_steps)
        return TrainedPolicy(policy, n_action_steps=n_action_steps)
    processor = PolicyProcessor.load(root)  # small: check before the weights load
    emb = processor.embodiments[0]
    check_compatible(suite, processor.cameras, emb.state_dim, emb.action_dim)
    from longboat.embodied.inference import load_policy

    return TrainedPolicy(load_policy(root, device=device), n_action_steps=n_action_steps)


def evaluate(
    suite: SuiteSpec,
    policy: ActingPolicy,
    out: str | Path,
    *,
    episodes: int,
    num_envs: int = 1,
    seed: int = 0,
    max_steps: int | None = None,
    videos: int = 0,
    tasks: Sequence[str] | None = None,
    processes: bool = False,
    progress: bool = True,
    policy_name: str = "",
) -> dict[str, Any]:
    """Roll ``policy`` out for ``episodes`` episodes of every task (or ``tasks``) of
    ``suite``, record the first ``videos`` episodes of each task, write the results into
    ``out`` and return them."""
    check_installed(suite)
    if episodes < 1 or num_envs < 1 or videos < 0:
        raise ConfigError(
            f"episodes={episodes}, num_envs={num_envs} and videos={videos} must be >= 1, "
            ">= 1 and >= 0",
            key="--episodes",
            value=episodes,
        )
    chosen = [suite.task(t) for t in tasks] if tasks else list(suite.tasks)
    out = Path(out)
    by_task: dict[str, list[EpisodeResult]] = {}
    start = time.perf_counter()
    with _Progress(len(chosen) * episodes, enabled=progress) as bar:
        for task in chosen:
            by_task[task.name] = run_task(
                suite,
                task,
                policy,
                episodes=episodes,
                num_envs=num_envs,
                seed=seed,
                max_steps=max_steps,
                record=videos,
                processes=processes,
                on_episode=bar.episode_done,
            )
    wall = time.perf_counter() - start
    written = []
    for eps in by_task.values():
        written += write_videos(out, eps, suite.fps)
    settings = {
        "policy": policy_name,
        "seed": seed,
        "episodes_per_task": episodes,
        "num_envs": min(num_envs, episodes),
        "max_steps": suite.max_episode_steps if max_steps is None else max_steps,
    }
    results = build_results(suite.name, by_task, settings=settings, videos=written, wall_s=wall)
    write_results(out, results)
    return results


class _Progress:
    """A rich progress bar over the episodes (successes so far in its text)."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total, self.enabled, self.done, self.wins = total, enabled, 0, 0
        self.bar: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bar = Progress(
                TextColumn("eval"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[wins]}"),
            )
            self.bar.start()
            self.id = self.bar.add_task("episodes", total=self.total, wins="")
        return self

    def episode_done(self, result: EpisodeResult) -> None:
        self.done += 1
        self.wins += int(result.success)
        if self.bar is not None:
            self.bar.update(self.id, completed=self.done, wins=f"{self.wins} succeeded")

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


__all__ = [
    "check_compatible",
    "evaluate",
    "load_acting_policy",
    "policy_dir",
    "remap_cameras",
]
