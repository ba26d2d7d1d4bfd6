"""The LLM model config: core's decoder model config (one definition for every stack)."""

from longboat.core.megatron.models.config import ARCH_FIELDS, DecoderModelConfig

LLMModelConfig = DecoderModelConfig
"""The ``model`` section of an llm experiment (a decoder-only LM)."""

__all__ = ["ARCH_FIELDS", "LLMModelConfig"]
