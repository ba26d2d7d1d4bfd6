"""LoRA on a VLM's language model (``lora.*``): core's adapters on the decoder only.

``apply_language_lora`` puts ``longboat.core.megatron.lora`` adapters on the decoder's
tensor-parallel linears (``lora.targets``) and freezes the decoder's base weights; the
vision tower and the projector train or not as ``model.freeze`` says. It runs before
megatron's DDP is built, so only the adapters and the unfrozen components get gradient
buffers and optimizer state. The adapters are parameters of the model, so checkpoints and
resume carry them like any other weight. ``merged_language(model)`` is the ``with`` block
an HF export runs in: the adapters folded into the decoder's weights, put back afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from longboat.core.config.errors import ConfigError

__all__ = ["apply_language_lora", "merged_language"]


def apply_language_lora(model: Any, lora: Any, *, frozen: Sequence[str] = (), seed: int = 0) -> int:
    """Adapters on ``model.language`` when ``lora`` (a core ``LoRAConfig``) is enabled;
    returns how many linears got one (0 without LoRA)."""
    if lora is None or not lora.enabled:
        return 0
    from longboat.core.megatron.lora import apply_lora

    if lora.rank < 1:
        raise ConfigError("must be >= 1", key="lora.rank", value=lora.rank)
    if "language" in frozen:
        raise ConfigError(
            "freezes the language model that lora.enabled=true trains adapters on",
            key="model.freeze",
            value=list(frozen),
            fix="remove language from model.freeze (LoRA freezes the decoder's base weights)",
        )
    targets = list(lora.targets)
    try:
        return apply_lora(
            [model.language], rank=lora.rank, alpha=lora.alpha, targets=targets, seed=seed
        )
    except ValueError:
        raise ConfigError(
            "matched no tensor-parallel linear of the language model",
            key="lora.targets",
            value=targets,
            fix="use any of linear_qkv, linear_proj, linear_fc1, linear_fc2",
        ) from None


def merged_language(model: Any) -> AbstractContextManager[int]:
    """Inside the block the decoder's adapters are merged into its weights and absent from
    the module (what ``save_hf`` writes); afterwards the model is exactly as before."""
    from longboat.core.megatron.lora import merged_lora

    return merged_lora([model.language])
