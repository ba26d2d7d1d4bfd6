"""``logging.trackers``: the trackers there are, what each needs installed, and the check
that runs before any work (the trackers themselves: ``longboat.core.loop.trackers``)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from typing import Any

TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "longboat-core[tensorboard]"),
    "wandb": ("wandb", "longboat-core[wandb]"),
    "mlflow": ("mlflow", "longboat-core[mlflow]"),
}
"""Tracker name -> (the module it needs, what to install for it)."""

WANDB_MODES = ("offline", "online")
"""``logging.wandb_mode`` values."""


def installed(name: str) -> bool:
    """Whether the package tracker ``name`` needs can be imported."""
    module = TRACKERS[name][0]
    if module in sys.modules:  # imported already, or marked not importable (None)
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def tracker_names(trackers: list[str] | None) -> list[str]:
    """The trackers a run uses: ``logging.trackers``, or with null TensorBoard where it is
    installed."""
    if trackers is None:
        return ["tensorboard"] if installed("tensorboard") else []
    return list(dict.fromkeys(trackers))


def tracker_problems(logging: Any, problems: Any) -> None:
    """Add to ``problems`` (a ``ProblemCollector``) every unknown tracker, every named
    tracker whose package is missing (naming the extra to install) and a bad
    ``logging.wandb_mode``."""
    names = logging.get("trackers") if isinstance(logging, Mapping) else None
    if names is None:
        return
    for name in names:
        if name not in TRACKERS:
            problems.add(
                "logging.trackers",
                f"unknown tracker {name!r}",
                value=list(names),
                fix=f"use some of: {', '.join(TRACKERS)}",
            )
        elif not installed(name):
            problems.add(
                "logging.trackers",
                f"{name} is not installed",
                value=list(names),
                fix=f'pip install "{TRACKERS[name][1]}", or drop {name} from logging.trackers',
            )
    mode = logging.get("wandb_mode")
    if "wandb" in names and mode not in WANDB_MODES:
        problems.add(
            "logging.wandb_mode", "unsupported value", value=mode, fix="use offline or online"
        )


__all__ = ["TRACKERS", "WANDB_MODES", "installed", "tracker_names", "tracker_problems"]
