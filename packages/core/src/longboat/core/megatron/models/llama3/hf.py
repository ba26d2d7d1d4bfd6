"""Llama 3 <-> Hugging Face ``LlamaForCausalLM`` config."""

from __future__ import annotations

from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.models.common import common_from_hf, common_to_hf
from longboat.core.megatron.models.config import DecoderModelConfig


def from_hf_config(hf: dict[str, Any]) -> DecoderModelConfig:
    """Model config from a Llama ``config.json`` dict."""
    if hf.get("mlp_bias"):
        raise ConfigError("config.json: mlp_bias=true is not supported for llama3.")
    return DecoderModelConfig(**common_from_hf(hf, "llama3", "config.json"))


def to_hf_config(cfg: DecoderModelConfig) -> Any:
    """``transformers.LlamaConfig`` for ``cfg``."""
    from transformers import LlamaConfig

    return LlamaConfig(**common_to_hf(cfg), architectures=["LlamaForCausalLM"])
