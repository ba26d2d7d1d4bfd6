"""(Re-)initialise a model's weights in place, e.g. after building it on the ``meta`` device,
sharding it and materialising it with ``to_empty``."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_weights(model: nn.Module) -> nn.Module:
    """Call ``reset_parameters()`` on every submodule that has one (torch layers and
    longboat's own: norms, adaRMSNorm, per-embodiment layers, ViT position table, ...),
    drawing from the current RNG state (seed it first for identical weights on every rank).
    Returns the model."""
    # Children first, so a parent's own init (e.g. adaRMSNorm zeroing its Dense) wins.
    for module in reversed(list(model.modules())):
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    return model
