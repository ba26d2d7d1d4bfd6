"""An evaluation's outputs: ``results.json``, ``results.md`` (the table) and the videos.

``results.json`` holds, per task and for the suite, the episodes, successes, success rate
and its Wilson 95% interval, the mean steps of the episodes and each episode's seed, outcome
and steps; ``results.md`` is the same summary as a markdown table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from longboat.embodied.eval.rollout import EpisodeResult
from longboat.embodied.eval.stats import wilson_interval

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
VIDEOS_DIR = "videos"


def summarize(name: str, episodes: Sequence[EpisodeResult]) -> dict[str, Any]:
    """Episodes, successes, success rate, Wilson 95% interval and mean steps of a group."""
    n = len(episodes)
    wins = sum(1 for e in episodes if e.success)
    low, high = wilson_interval(wins, n)
    return {
        "name": name,
        "episodes": n,
        "successes": wins,
        "success_rate": wins / n if n else 0.0,
        "ci95": [low, high],
        "mean_steps": float(np.mean([e.steps for e in episodes])) if n else 0.0,
    }


def write_videos(out: Path, episodes: Sequence[EpisodeResult], fps: int) -> list[str]:
    """One mp4 per recorded episode (``videos/<task>_ep<k>.mp4``); the paths written,
    relative to ``out``."""
    from longboat.embodied.data.video_encode import encode_mp4

    written = []
    for e in episodes:
        if not e.frames:
            continue
        frames = np.stack(e.frames)
        h, w = frames.shape[1:3]
        frames = frames[:, : h - h % 2, : w - w % 2]  # yuv420p needs even sizes
        rel = f"{VIDEOS_DIR}/{e.task}_ep{e.episode:03d}.mp4"
        encode_mp4(out / rel, [frames], fps, crf=23, gop=max(fps, 1))
        written.append(rel)
    return written


def build_results(
    suite: str,
    by_task: Mapping[str, Sequence[EpisodeResult]],
    *,
    settings: Mapping[str, Any],
    videos: Sequence[str],
    wall_s: float,
) -> dict[str, Any]:
    """The ``results.json`` body."""
    everything = [e for eps in by_task.values() for e in eps]
    tasks = []
    for name, eps in by_task.items():
        row = summarize(name, eps)
        row["per_episode"] = [
            {"episode": e.episode, "seed": e.seed, "success": e.success, "steps": e.steps,
             "reward": e.reward}
            for e in eps
        ]  # fmt: skip
        tasks.append(row)
    return {
        "suite": suite,
        **dict(settings),
        "tasks": tasks,
        "total": summarize(suite, everything),
        "videos": list(videos),
        "wall_s": wall_s,
        "episodes_per_s": len(everything) / wall_s if wall_s > 0 else None,
    }


def markdown_table(results: Mapping[str, Any]) -> str:
    """The summary table: one row per task and one for the suite."""

    def row(r: Mapping[str, Any], bold: bool = False) -> str:
        low, high = r["ci95"]
        name = f"**{r['name']} (suite)**" if bold else r["name"]
        return (
            f"| {name} | {r['episodes']} | {r['successes']} | {100 * r['success_rate']:.1f}% "
            f"| {100 * low:.1f}-{100 * high:.1f}% | {r['mean_steps']:.1f} |"
        )

    lines = [
        "| task | episodes | successes | success rate | 95% CI (Wilson) | mean steps |",
        "|---|---:|---:|---:|---:|---:|",
        *(row(t) for t in results["tasks"]),
    ]
    if len(results["tasks"]) > 1:
        lines.append(row(results["total"], bold=True))
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``results.json`` and ``results.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / RESULTS_JSON
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    md_path = out / RESULTS_MD
    head = (
        f"# {results['suite']}: closed-loop evaluation\n\n"
        f"Policy `{results.get('policy')}`, seed {results.get('seed')}, "
        f"{results.get('episodes_per_task')} episode(s) per task, at most "
        f"{results.get('max_steps')} steps each.\n\n"
    )
    md_path.write_text(head + markdown_table(results))
    return json_path, md_path


__all__ = [
    "RESULTS_JSON",
    "RESULTS_MD",
    "build_results",
    "markdown_table",
    "summarize",
    "write_results",
    "write_videos",
]
