"""The normaliser statistics and processor files of the Isaac-GR00T N1.6 release layout.

Beside ``config.json`` and the weights, an Isaac-GR00T N1.6 checkpoint keeps what its
processor (``Gr00tN1d6Processor``) reads:

- ``statistics.json``: ``{embodiment_tag: {"state" | "action": {joint_group: {"min", "max",
  "mean", "std", "q01", "q99": [floats]}}}}``, one entry per joint group of the embodiment;
- ``processor_config.json``: ``{"processor_class": "Gr00tN1d6Processor", "processor_kwargs":
  {...}}`` with each embodiment's modality configs (video / state / action / language keys and
  delta indices) and the normalisation switches (``use_percentiles``: q01 / q99 in place of
  min / max; ``clip_outliers``: clip to [-1, 1]);
- ``embodiment_id.json``: ``{embodiment_tag: index of its per-embodiment layers}``.

longboat writes one embodiment per sub-dataset of a run (``Embodiment``): tag
``new_embodiment`` (Isaac-GR00T's post-training tag) for a single dataset, else the
sub-dataset's folder name; its joint groups from GR00T's ``meta/modality.json`` when the
dataset has one, else one group per feature (``state``, ``action``); min / max with
clipping, as longboat normalises (``use_percentiles=false``, ``clip_outliers=true``).
``model.init_from`` reads them back (``checkpoint_stats``): a sub-dataset whose tag the
checkpoint has statistics for is normalised with those, as Isaac-GR00T keeps a checkpoint's
statistics for a tag it knows; the others with their own ``meta/stats.json``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from longboat.core.config.errors import ConfigError

STATISTICS_NAME = "statistics.json"
PROCESSOR_NAME = "processor_config.json"
EMBODIMENT_ID_NAME = "embodiment_id.json"
PROCESSOR_CLASS = "Gr00tN1d6Processor"
SINGLE_TAG = "new_embodiment"
STATS = ("min", "max", "mean", "std", "q01", "q99")
FEATURES = {"state": "observation.state", "action": "action"}
"""Isaac-GR00T modality -> the LeRobot feature its joint groups slice."""


@dataclass(frozen=True)
class Embodiment:
    """One embodiment of a run as the Isaac layout records it."""

    tag: str
    embodiment_id: int
    groups: Mapping[str, Sequence[tuple[str, int, int]]]
    """``"state"`` / ``"action"`` -> ``[(joint group, start, end)]`` slices of the feature."""
    stats: Mapping[str, Mapping[str, Any]]
    """``{feature: {stat: values}}`` the run normalised with (full feature width)."""
    cameras: Sequence[str] = ()
    """Camera keys (``observation.images.<name>``) in batch order."""
    language_key: str = "task"


def embodiment_tags(names: Sequence[str]) -> list[str]:
    """Tags of a run's sub-datasets (their folder names): ``new_embodiment`` for one."""
    return [SINGLE_TAG] if len(names) == 1 else list(names)


def joint_groups(
    modality: Mapping[str, Any] | None, widths: Mapping[str, int]
) -> dict[str, list[tuple[str, int, int]]]:
    """Joint groups per modality from GR00T's ``meta/modality.json`` (groups of the default
    feature, in file order), else one group named after the modality spanning the feature."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    for modality_name, feature in FEATURES.items():
        section = (modality or {}).get(modality_name) or {}
        groups = [
            (name, int(spec["start"]), int(spec["end"]))
            for name, spec in section.items()
            if spec.get("original_key", feature) == feature
        ]
        covered = sorted((a, b) for _, a, b in groups)
        contiguous = [a for a, _ in covered] == [0, *(b for _, b in covered[:-1])]
        if not groups or not contiguous or covered[-1][1] != widths[feature]:
            groups = [(modality_name, 0, widths[feature])]
        out[modality_name] = groups
    return out


def isaac_statistics(embodiments: Sequence[Embodiment]) -> dict[str, Any]:
    """``statistics.json``'s content for ``embodiments`` (each stat sliced per joint group)."""
    out: dict[str, Any] = {}
    for emb in embodiments:
        entry: dict[str, Any] = {}
        for modality, feature in FEATURES.items():
            stats = emb.stats[feature]
            entry[modality] = {
                name: {
                    stat: np.asarray(stats[stat], dtype=np.float64).reshape(-1)[a:b].tolist()
                    for stat in STATS
                    if stat in stats
                }
                for name, a, b in emb.groups[modality]
            }
        out[emb.tag] = entry
    return out


def _modality_config(keys: Sequence[str], delta: Sequence[int]) -> dict[str, Any]:
    return {
        "delta_indices": list(delta),
        "modality_keys": list(keys),
        "sin_cos_embedding_keys": None,
        "mean_std_embedding_keys": None,
        "action_configs": None,
    }


def save_isaac_processor(
    directory: str | Path, isaac_cfg: Mapping[str, Any], embodiments: Sequence[Embodiment]
) -> list[Path]:
    """Write ``statistics.json``, ``processor_config.json`` and ``embodiment_id.json`` for a
    checkpoint whose ``config.json`` is ``isaac_cfg`` (``isaac_config_for``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    horizon = int(isaac_cfg["action_horizon"])
    modality_configs = {
        emb.tag: {
            "video": _modality_config([c.rsplit(".", 1)[-1] for c in emb.cameras], [0]),
            "state": _modality_config([g for g, _, _ in emb.groups["state"]], [0]),
            "action": _modality_config([g for g, _, _ in emb.groups["action"]], range(horizon)),
            "language": _modality_config([emb.language_key], [0]),
        }
        for emb in embodiments
    }
    processor = {
        "processor_class": PROCESSOR_CLASS,
        "processor_kwargs": {
            "modality_configs": modality_configs,
            "image_crop_size": None,
            "image_target_size": None,
            "use_albumentations": False,
            "random_rotation_angle": None,
            "color_jitter_params": None,
            "shortest_image_edge": isaac_cfg.get("shortest_image_edge"),
            "crop_fraction": isaac_cfg.get("crop_fraction"),
            "model_name": isaac_cfg.get("model_name"),
            "model_type": "eagle",
            "formalize_language": True,
            "max_state_dim": int(isaac_cfg["max_state_dim"]),
            "max_action_dim": int(isaac_cfg["max_action_dim"]),
            "max_action_horizon": horizon,
            "use_percentiles": False,
            "clip_outliers": True,
            "apply_sincos_state_encoding": False,
            "use_relative_action": False,
        },
    }
    files = {
        STATISTICS_NAME: isaac_statistics(embodiments),
        PROCESSOR_NAME: processor,
        EMBODIMENT_ID_NAME: {emb.tag: emb.embodiment_id for emb in embodiments},
    }
    written = []
    for name, body in files.items():
        (directory / name).write_text(json.dumps(body, indent=2) + "\n")
        written.append(directory / name)
    return written


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err})", key="model.init_from") from err


def checkpoint_stats(
    directory: str | Path, tag: str, widths: Mapping[str, int]
) -> dict[str, dict[str, np.ndarray]] | None:
    """``{feature: {stat: values}}`` of ``tag`` from an Isaac checkpoint's ``statistics.json``
    (joint groups joined in the processor config's order), ready for a min / max normaliser:
    with ``use_percentiles`` its q01 / q99 stand in for min / max. None when the directory
    has no statistics for ``tag``; a ConfigError when they do not fit ``widths``."""
    directory = Path(directory)
    path = directory / STATISTICS_NAME
    if not path.is_file():
        return None
    statistics = _read(path)
    if not isinstance(statistics, dict) or tag not in statistics:
        return None
    kwargs: dict[str, Any] = {}
    if (directory / PROCESSOR_NAME).is_file():
        kwargs = (_read(directory / PROCESSOR_NAME) or {}).get("processor_kwargs") or {}
    configs = (kwargs.get("modality_configs") or {}).get(tag) or {}
    out: dict[str, dict[str, np.ndarray]] = {}
    for modality, feature in FEATURES.items():
        groups = statistics[tag].get(modality) or {}
        order = (configs.get(modality) or {}).get("modality_keys") or list(groups)
        missing = [g for g in order if g not in groups]
        if missing or not order:
            raise ConfigError(
                f"{path}: {tag!r} has no {modality} statistics for joint groups "
                f"{missing or order or '(none)'}",
                key="model.init_from",
            )
        common = [s for s in STATS if all(s in groups[g] for g in order)]
        joined = {
            s: np.concatenate([np.asarray(groups[g][s], dtype=np.float64) for g in order])
            for s in common
        }
        if kwargs.get("use_percentiles") and "q01" in joined and "q99" in joined:
            joined["min"], joined["max"] = joined["q01"], joined["q99"]
        need = [s for s in ("min", "max", "mean") if s not in joined]
        if need:
            raise ConfigError(
                f"{path}: {tag!r} {modality} statistics lack {need}", key="model.init_from"
            )
        width = int(joined["mean"].shape[0])
        if width != int(widths[feature]):
            raise ConfigError(
                f"{path}: {tag!r} has {width} {modality} dims, the dataset's {feature} "
                f"{widths[feature]}",
                key="model.init_from",
                fix="train on the embodiment the checkpoint's statistics describe, or start "
                "from a checkpoint without statistics for this tag",
            )
        out[feature] = joined
    return out
