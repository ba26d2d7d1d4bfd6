"""Frozen-module control: which parts train, and the reference's dtype split
(trainable parameters fp32, frozen ones bf16)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class FreezingGroups:
    """The parts a model exposes to ``apply_freezing``."""

    visual: list[nn.Module]
    """Vision tower and its projector (``tune_visual``)."""
    llm_layers: list[nn.Module]
    """Language-model layers in order (``tune_llm`` / ``tune_top_llm_layers``)."""
    llm_rest: list[nn.Module]
    """Other LM parts (embeddings), trained only with ``tune_llm``."""
    action_head: list[nn.Module]
    """Action-side modules (``tune_action_head``)."""
    always_frozen: list[nn.Parameter] = field(default_factory=list)
    """Parameters that cannot affect the loss (kept frozen so DDP sees no unused grads)."""


def resolve_dtype(name: str) -> torch.dtype:
    """'bfloat16' / 'float16' / 'float32' -> torch dtype."""
    if name not in _DTYPES:
        raise ValueError(f"frozen_dtype={name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _set(modules: list[nn.Module], flag: bool) -> None:
    for m in modules:
        m.requires_grad_(flag)


def apply_freezing(model: nn.Module, cfg: Any = None) -> dict[str, int]:
    """Set ``requires_grad`` from ``cfg.tune_visual / tune_llm / tune_top_llm_layers /
    tune_action_head`` and cast frozen parameters to ``cfg.frozen_dtype`` (trainable ones
    to fp32). ``cfg`` defaults to ``model.cfg``. Returns parameter counts."""
    cfg = cfg if cfg is not None else model.cfg
    groups: FreezingGroups = model.freezing_groups()
    model.requires_grad_(True)
    layers = groups.llm_layers
    top = cfg.tune_top_llm_layers
    if not 0 <= top <= len(layers):
        raise ValueError(
            f"tune_top_llm_layers={top} must be in [0, {len(layers)}] (the LM layers built)"
        )
    if not cfg.tune_visual:
        _set(groups.visual, False)
    if not cfg.tune_llm:
        _set(groups.llm_rest, False)
        _set(layers[: len(layers) - top], False)
    if not cfg.tune_action_head:
        _set(groups.action_head, False)
    for p in groups.always_frozen:
        p.requires_grad_(False)
    frozen_dtype = resolve_dtype(cfg.frozen_dtype)
    counts = {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        p.data = p.data.to(torch.float32 if p.requires_grad else frozen_dtype)
        counts["trainable" if p.requires_grad else "frozen"] += p.numel()
    return counts
