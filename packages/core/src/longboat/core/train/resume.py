"""Resume that honours the config: what changed since the checkpoint, what must not change.

The checkpoint restores the model, the optimizer state (moments, step counts, main weights),
the data position, the RNG streams, the NaN-guard counters and the LR schedule's position.
Everything the config sets wins over the checkpoint: the optimizer's hyperparameters
(``optim.lr``, weight decay, betas, ...) are put back to this run's values after the load,
and the LR schedule is this run's schedule at the restored position (``RunSchedule``). The
keys that differ from the checkpoint's config are announced on the first line of the run.

Keys a checkpoint cannot follow (the parallel layout of sharded state, the model shape)
are the stack's ``Training.resume_keys``: a mismatch stops the run before anything loads,
naming the key, both values and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from longboat.core.checkpoint.errors import CheckpointError

IGNORED_CHANGES = ("checkpoint.resume", "logging.progress")
"""Keys that differ between runs without changing what is trained."""


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return float(a) == float(b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def changed_keys(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple]:
    """``key -> (checkpoint's value, this run's value)`` for every leaf that differs."""
    old, new = flatten(saved), flatten(current)
    out = {}
    for key in sorted(set(old) | set(new)):
        if key.startswith(IGNORED_CHANGES):
            continue
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if not _same(a, b):
            out[key] = (a, b)
    return out


def describe_changes(changes: Mapping[str, tuple], *, limit: int = 8) -> str:
    """``train.steps 30 -> 70, optim.lr 0.003 -> 0.01`` (the first ``limit`` keys)."""
    parts = [f"{key} {a!r} -> {b!r}" for key, (a, b) in list(changes.items())[:limit]]
    more = len(changes) - limit
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def check_resume_keys(
    path: Path, saved: Mapping[str, Any], current: Mapping[str, Any], keys: tuple[str, ...]
) -> None:
    """``CheckpointError`` naming every ``keys`` entry whose value differs from the checkpoint's."""
    old, new = flatten(saved), flatten(current)
    bad = [k for k in keys if k in old and not _same(old[k], new.get(k))]
    if not bad:
        return
    pairs = ", ".join(f"{k}={old[k]!r} (this run: {new.get(k)!r})" for k in bad)
    same = " ".join(f"{k}={old[k]}" for k in bad)
    raise CheckpointError(
        f"{path} was saved with {pairs}; its sharded state cannot be loaded into this layout. "
        f"Fix: resume with the same settings ({same}), or start over with "
        "checkpoint.resume=none"
    )


def _precision_recipe(flat: Mapping[str, Any]) -> str:
    precision = flat.get("train.precision")
    if precision == "fp8":
        return f"fp8 ({flat.get('train.fp8.recipe', 'blockwise')})"
    return str(precision)


def check_precision_resume(
    path: Path, saved: Mapping[str, Any], current: Mapping[str, Any]
) -> None:
    """``CheckpointError`` where an FP8 run resumes a checkpoint trained in another precision
    or FP8 recipe, or a run resumes an FP8 checkpoint in another precision, unless the run
    sets ``train.fp8.allow_recipe_change=true``; the loss curve would change its character at
    the resume point without anyone asking for it."""
    old, new = flatten(saved), flatten(current)
    if "train.precision" not in old or new.get("train.fp8.allow_recipe_change"):
        return
    before, after = _precision_recipe(old), _precision_recipe(new)
    if before == after or "fp8" not in before + after:
        return
    raise CheckpointError(
        f"{path} was trained with train.precision={before}; this run asks for {after}. "
        "Fix: resume with the checkpoint's train.precision / train.fp8.recipe, set "
        "train.fp8.allow_recipe_change=true to continue in the new one, or start over with "
        "checkpoint.resume=none"
    )


class Hyperparameters:
    """The param-group settings of the freshly built optimizers (from the config), put back
    after a checkpoint's param groups overwrote them (``restore``)."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.saved = [
            [{k: _copy(v) for k, v in g.items() if k != "params"} for g in o.param_groups]
            for o in optimizers
        ]
        self.optimizers = optimizers

    def restore(self) -> None:
        for optimizer, groups in zip(self.optimizers, self.saved):
            for group, values in zip(optimizer.param_groups, groups):
                for key, value in values.items():
                    current = group.get(key)
                    if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                        current.copy_(value)
                    else:
                        group[key] = value


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


__all__ = [
    "IGNORED_CHANGES",
    "Hyperparameters",
    "changed_keys",
    "check_precision_resume",
    "check_resume_keys",
    "describe_changes",
    "flatten",
]
