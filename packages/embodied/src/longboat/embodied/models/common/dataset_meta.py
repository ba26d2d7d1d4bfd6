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
