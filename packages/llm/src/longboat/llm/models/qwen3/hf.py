"""Qwen3 dense <-> Hugging Face ``Qwen3ForCausalLM`` config."""

from __future__ import annotations

from typing import Any

from longboat.llm.config import LLMModelConfig
from longboat.llm.models._hf_common import common_from_hf, common_to_hf


def from_hf_config(hf: dict[str, Any]) -> LLMModelConfig:
    """Model config from a Qwen3 ``config.json`` dict (qk-norm always on)."""
    return LLMModelConfig(**common_from_hf(hf, "qwen3", "config.json"), qk_norm=True)


def to_hf_config(cfg: LLMModelConfig) -> Any:
    """``transformers.Qwen3Config`` for ``cfg``."""
    from transformers import Qwen3Config

    return Qwen3Config(**common_to_hf(cfg), architectures=["Qwen3ForCausalLM"])
