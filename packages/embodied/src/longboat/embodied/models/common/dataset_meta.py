"""The two dataset files a reference-format export reads: ``meta/info.json`` (feature
widths) and ``meta/stats.json`` (normaliser statistics)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError

STATE_KEY, ACTION_KEY = "observation.state", "action"
"""The LeRobot features every policy reads as state and predicts as action."""


def dataset_meta(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(info.json, stats.json)`` of the LeRobot dataset ``root`` (a ConfigError naming
    ``--dataset`` when one is missing)."""
    info_path, stats_path = root / "meta" / "info.json", root / "meta" / "stats.json"
    for path in (info_path, stats_path):
        if not path.is_file():
            raise ConfigError(f"{path} does not exist", key="--dataset", value=str(root))
    return json.loads(info_path.read_text()), json.loads(stats_path.read_text())


def state_action_features(
    root: Path, stats: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(features, stats)`` of the LeRobot dataset ``root``: ``meta/info.json``'s features
    and ``stats`` (default: ``meta/stats.json``); a ConfigError naming ``--dataset`` when
    the state or the action lacks either."""
    info, dataset_stats = dataset_meta(root)
    stats = dataset_stats if stats is None else stats
    feats = info.get("features", {})
    missing = [k for k in (STATE_KEY, ACTION_KEY) if k not in feats or k not in stats]
    if missing:
        raise ConfigError(f"{root} has no features / stats for {missing}", key="--dataset")
    return feats, stats
