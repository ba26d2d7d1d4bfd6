"""Qwen3 dense <-> Hugging Face ``Qwen3ForCausalLM`` config."""

from __future__ import annotations

from typing import Any

from longboat.core.megatron.models.common import common_from_hf, common_to_hf
from longboat.core.megatron.models.config import DecoderModelConfig


def from_hf_config(hf: dict[str, Any]) -> DecoderModelConfig:
    """Model config from a Qwen3 ``config.json`` dict (qk-norm always on)."""
    return DecoderModelConfig(**common_from_hf(hf, "qwen3", "config.json"), qk_norm=True)


def to_hf_config(cfg: DecoderModelConfig) -> Any:
    """``transformers.Qwen3Config`` for ``cfg``."""
    from transformers import Qwen3Config

    return Qwen3Config(**common_to_hf(cfg), architectures=["Qwen3ForCausalLM"])
