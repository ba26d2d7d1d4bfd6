"""Per-block activation checkpointing (recompute a block's activations in backward)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from longboat.core.config.errors import require_choice
from longboat.core.config.schema import RECOMPUTE_MODES

AC_MODES = RECOMPUTE_MODES
"""``none``, ``full``, ``selective``: core's ``train.recompute`` (checked at compose time)."""


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module], mode: str) -> int:
    """Wrap blocks in non-reentrant checkpointing; returns how many were wrapped.

    ``full`` wraps every block; ``selective`` wraps every second block (half the
    recompute for about half the activation saving, torchtitan's layer-frequency
    selective mode); ``none`` wraps nothing. Wrapping swaps the block in its
    parent module, so it must run before FSDP sharding and optimizer creation.
    """
    require_choice(mode, AC_MODES, key="train.recompute", what="activation recompute mode")
    if mode == "none":
        return 0
    chosen = blocks if mode == "full" else blocks[::2]
    targets = {id(b) for b in chosen}
    # Collect first: swapping children while walking the tree would revisit wrappers.
    sites = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if id(child) in targets
    ]
    for parent, name, child in sites:
        setattr(
            parent, name, checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        )
    return len(sites)
