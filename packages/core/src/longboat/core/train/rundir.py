"""A run's files beside its metrics: the resolved config, the loss curve, a fresh start.

- ``save_config``: ``<logging.dir>/<run_name>/config.yaml``, the config the run trained with.
- ``set_aside``: ``checkpoint.resume=none`` renames the previous run's checkpoint folder and
  metrics folder to ``<name>.set-aside-<UTC time>``, so a later ``resume=auto`` run cannot
  pick up a stale, unrelated run and nothing is deleted.
- ``plot_loss_curve``: ``loss_curve.png`` from ``metrics.jsonl`` (every run so far; a step
  logged twice keeps its latest value), with the held-out metrics when there are any.
"""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

PLOT_NAME = "loss_curve.png"
CONFIG_NAME = "config.yaml"


def save_config(cfg: Any, run_dir: Path) -> Path:
    """Write the resolved config as YAML into ``run_dir``; returns the file."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(cfg) if dataclasses.is_dataclass(cfg) else OmegaConf.create(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_NAME
    tmp = path.with_name(CONFIG_NAME + ".partial")
    tmp.write_text(OmegaConf.to_yaml(node, resolve=True), encoding="utf-8")
    tmp.replace(path)
    return path


def set_aside(paths: list[Path], *, now: datetime | None = None) -> list[tuple[Path, Path]]:
    """Rename every existing, non-empty folder of ``paths`` to ``<name>.set-aside-<time>``;
    returns the (old, new) pairs."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
    moved = []
    for path in paths:
        if not path.is_dir() or not any(path.iterdir()):
            continue
        target = path.with_name(f"{path.name}.set-aside-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}.set-aside-{stamp}-{n}")
        path.rename(target)
        moved.append((path, target))
    return moved


def _read_curves(metrics_path: Path) -> tuple[dict[int, float], dict[str, dict[int, float]]]:
    train: dict[int, float] = {}
    held_out: dict[str, dict[int, float]] = {}
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        step = row.get("step")
        if not isinstance(step, int):
            continue
        for key, value in row.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if not math.isfinite(value):
                continue
            if key == "loss":
                train[step] = float(value)
            elif key.startswith("eval_"):
                held_out.setdefault(key, {})[step] = float(value)
    return train, held_out


def plot_loss_curve(metrics_path: Path, out: Path | None = None, *, title: str = "") -> Path | None:
    """The loss curve of ``metrics_path`` as a PNG (default: beside it); None when there is
    nothing to plot or matplotlib cannot be imported."""
    if not metrics_path.is_file():
        return None
    train, held_out = _read_curves(metrics_path)
    if not train:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    out = out or metrics_path.with_name(PLOT_NAME)
    fig = loss_curve_figure(train, held_out, title=title or metrics_path.parent.name)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


FEW_POINTS = 30
"""Below this many logged steps each point is drawn (a line of one point draws nothing)."""


def loss_curve_figure(
    train: dict[int, float], held_out: dict[str, dict[int, float]], *, title: str = ""
) -> Any:
    """The matplotlib figure of the train loss by step and each held-out curve."""
    import matplotlib.pyplot as plt

    steps = sorted(train)
    fig, ax = plt.subplots(figsize=(7, 4))
    marker = "o" if len(steps) < FEW_POINTS else None
    ax.plot(steps, [train[s] for s in steps], lw=1.2, marker=marker, ms=3, label="train loss")
    for key, curve in sorted(held_out.items()):
        xs = sorted(curve)
        ax.plot(xs, [curve[s] for s in xs], "o-", ms=3, lw=1.0, label=key.replace("_", " "))
    values = [v for v in train.values()]
    if min(values) > 0 and max(values) / min(values) > 20:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


__all__ = [
    "CONFIG_NAME",
    "PLOT_NAME",
    "loss_curve_figure",
    "plot_loss_curve",
    "save_config",
    "set_aside",
]
