"""Split a training ``state`` dict into what DCP shards and what each rank keeps itself.

* ``nn.Module`` and ``Optimizer`` values go through
  ``torch.distributed.checkpoint.state_dict`` (FQN-keyed, DDP/FSDP2-aware), so
  DCP can shard them and reshard them on load.
* Everything else (LR schedulers, samplers, RNG, NaN-guard counters, plain
  values) is small, often rank-specific, and goes into ``extra_rank{r}.pt``,
  read back with ``weights_only=True``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from longboat.core.checkpoint.errors import CheckpointError
from longboat.core.rng import RNGState

PRISTINE_OPTIMIZERS_KEY = "__longboat_pristine_optimizers__"
"""Extras entry listing optimizers that had no state yet when saved."""

__all__ = [
    "PRISTINE_OPTIMIZERS_KEY",
    "SplitState",
    "apply_extras",
    "load_sharded",
    "serialize_extras",
    "sharded_templates",
    "split_state",
]


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _owner_module(key: str, optim: torch.optim.Optimizer, state: dict[str, Any]) -> nn.Module:
    """The module in ``state`` whose parameters ``optim`` updates."""
    wanted = {id(p) for group in optim.param_groups for p in group["params"]}
    candidates = []
    for mod_key, value in state.items():
        if isinstance(value, nn.Module):
            params = {id(p) for p in value.parameters()}
            if wanted <= params:
                candidates.append((len(params), mod_key, value))
    if not candidates:
        raise CheckpointError(
            f"optimizer under state key {key!r} updates parameters of no nn.Module in the state; "
            "add the model it optimizes to the state dict (e.g. state['model'] = model)"
        )
    return min(candidates, key=lambda c: c[0])[2]  # the tightest fit


@dataclass
class SplitState:
    """The parts of a training state, ready to write."""

    sharded: dict[str, Any] = field(default_factory=dict)
    """Key -> FQN-keyed state dict of a module or optimizer (saved by DCP)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Key -> ``state_dict()`` of a stateful object, or the plain value (saved per rank)."""


def split_state(state: dict[str, Any]) -> SplitState:
    """Capture the state dicts of everything in ``state`` now."""
    out = SplitState()
    for key, value in state.items():
        if not isinstance(key, str) or not key:
            raise CheckpointError(f"state keys must be non-empty strings, got {key!r}")
        if isinstance(value, nn.Module):
            out.sharded[key] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            pristine = not value.state
            out.sharded[key] = get_optimizer_state_dict(_owner_module(key, value, state), value)
            if pristine:
                # get_optimizer_state_dict fills an empty optimizer by taking a zero-LR
                # step (AdamW's step count becomes 1). Undo it, and remember to undo it
                # after loading too, so a step-0 checkpoint changes nothing.
                value.state.clear()
                out.extras.setdefault(PRISTINE_OPTIMIZERS_KEY, []).append(key)
        elif _is_stateful(value):
            out.extras[key] = value.state_dict()
        else:
            out.extras[key] = value
    return out


def serialize_extras(extras: dict[str, Any]) -> bytes:
    """``torch.save`` bytes of ``extras``; fails now, naming the key, if a load could not read it."""
    buf = io.BytesIO()
    torch.save(extras, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        for key, value in extras.items():
            probe = io.BytesIO()
            torch.save(value, probe)
            probe.seek(0)
            try:
                torch.load(probe, weights_only=True)
            except Exception as inner:
                raise CheckpointError(
                    f"state[{key!r}] holds a type that weights_only loading refuses ({inner}); "
                    "store only tensors, numbers, strings, lists, tuples and dicts in it"
                ) from exc
        raise
    return data


def load_sharded(state: dict[str, Any], sharded: dict[str, Any]) -> None:
    """Push loaded module/optimizer state dicts back into the live objects."""
    for key, sd in sharded.items():
        value = state[key]
        if isinstance(value, nn.Module):
            set_model_state_dict(value, sd)
    for key, sd in sharded.items():
        value = state[key]
        if isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_owner_module(key, value, state), value, sd)


def sharded_templates(state: dict[str, Any]) -> dict[str, Any]:
    """Current state dicts of modules/optimizers: DCP's load targets (shapes, sharding)."""
    return split_state(
        {k: v for k, v in state.items() if isinstance(v, (nn.Module, torch.optim.Optimizer))}
    ).sharded


def apply_extras(state: dict[str, Any], extras: dict[str, Any], *, strict: bool) -> list[str]:
    """Load extras into ``state``; RNG last so nothing afterwards draws from it.

    Stateful objects get ``load_state_dict``; plain values replace the entry in
    ``state``. Returns the keys of ``state`` that the checkpoint did not hold.
    """
    missing = []
    wanted = [k for k, v in state.items() if not isinstance(v, (nn.Module, torch.optim.Optimizer))]
    wanted.sort(key=lambda k: isinstance(state[k], RNGState))  # stable: RNG at the end
    for key in wanted:
        if key not in extras:
            missing.append(key)
            continue
        value = state[key]
        if _is_stateful(value):
            value.load_state_dict(extras[key])
        else:
            state[key] = extras[key]
    for key in extras.get(PRISTINE_OPTIMIZERS_KEY, []):
        if isinstance(state.get(key), torch.optim.Optimizer):
            state[key].state.clear()
    if strict and missing:
        raise CheckpointError(
            f"the checkpoint holds no entry for state key(s) {missing}; it has "
            f"{sorted(k for k in extras if k != PRISTINE_OPTIMIZERS_KEY)}; remove those keys from the state or load with strict=False"
        )
    return missing
