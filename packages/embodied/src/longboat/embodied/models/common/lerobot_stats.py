"""Normaliser statistics as LeRobot's processor files hold them (``<feature>.<stat>`` float32
tensors), shared by the policies that write LeRobot processor files."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from longboat.core.config.errors import ConfigError

STATS = ("mean", "std", "min", "max", "q01", "q99")
NEEDED = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99")}
"""The statistics each LeRobot normalisation mode reads."""


def stats_tensors(
    stats: Mapping[str, Mapping[str, Any]],
    features: Mapping[str, Any],
    norm_map: Mapping[str, str],
) -> dict[str, torch.Tensor]:
    """``{feature.stat: tensor}`` of the STATE and ACTION ``features`` from ``stats``; a
    ConfigError lists every statistic a feature's normalisation mode needs and lacks, and
    every width that does not fit the feature."""
    out: dict[str, torch.Tensor] = {}
    problems = []
    for key, feat in features.items():
        if feat.get("type") not in ("STATE", "ACTION"):
            continue
        width = int(feat["shape"][0])
        if key not in stats:
            problems.append(f"no statistics for {key!r}")
            continue
        mode = norm_map.get(feat["type"], "IDENTITY")
        for stat in STATS:
            if stat not in stats[key]:
                if stat in NEEDED.get(mode, ()):
                    problems.append(f"{key!r} has no {stat!r} ({feat['type']} is {mode})")
                continue
            t = torch.as_tensor(stats[key][stat], dtype=torch.float32).flatten()
            if t.numel() != width:
                problems.append(f"{key}.{stat} has {t.numel()} values, the feature {width}")
                continue
            out[f"{key}.{stat}"] = t.contiguous()
    if problems:
        raise ConfigError("normaliser statistics do not fit the policy: " + "; ".join(problems))
    return out
