"""Safetensors checkpoints as the adapters read them (one file or the shards of an index),
and the one error that lists every key of a checkpoint that does not fit a model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from longboat.core.checkpoint.errors import CheckpointError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors`` or the shards its
    ``model.safetensors.index.json`` lists."""
    directory = Path(directory)
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a safetensors index ({err})") from err
        files = [directory / f for f in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} lists shards that do not exist: {absent}")
        return files
    raise CheckpointError(f"{directory} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def read_shapes(directory: str | Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint as a meta tensor of its shape (nothing is read)."""
    out: dict[str, Tensor] = {}
    for path in weight_files(directory):
        try:
            with safe_open(str(path), framework="pt") as f:
                for k in list(f.keys()):
                    out[k] = torch.empty(f.get_slice(k).get_shape(), device="meta")
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from err
    return out


def read_tensors(directory: str | Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint (all shards), on the CPU."""
    out: dict[str, Tensor] = {}
    for path in weight_files(directory):
        try:
            out.update(load_file(str(path)))
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from err
    return out


def mismatch_report(
    want: Mapping[str, tuple[int, ...]],
    have: Mapping[str, Tensor],
    *,
    ignored: tuple[str, ...] = (),
) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, mis-shaped) keys of ``have`` against ``want``; keys starting
    with an ``ignored`` prefix are never unexpected."""
    missing = sorted(k for k in want if k not in have)
    unexpected = sorted(k for k in have if k not in want and not k.startswith(ignored))
    misshaped = [
        f"{k}: {tuple(have[k].shape)} in the file, {tuple(want[k])} expected"
        for k in sorted(want)
        if k in have and tuple(have[k].shape) != tuple(want[k])
    ]
    return missing, unexpected, misshaped


def raise_on_mismatch(
    source: str,
    what: str,
    report: tuple[list[str], list[str], list[str]],
    fix: str,
    *,
    note: str | None = None,
) -> None:
    """One CheckpointError listing every missing / unexpected / mis-shaped key (if any)."""
    missing, unexpected, misshaped = report
    if not (missing or unexpected or misshaped):
        return
    lines = [f"{source} does not fit {what}:"]
    for title, keys in (
        ("missing", missing),
        ("unexpected", unexpected),
        ("mis-shaped", misshaped),
    ):
        if keys:
            shown = keys[:20] + ([f"... and {len(keys) - 20} more"] if len(keys) > 20 else [])
            lines.append(f"  {len(keys)} {title}: " + ", ".join(shown))
    if note:
        lines.append(f"  {note}")
    lines.append(f"  Fix: {fix}")
    raise CheckpointError("\n".join(lines))
