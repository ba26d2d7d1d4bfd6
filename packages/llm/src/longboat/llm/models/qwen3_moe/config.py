"""Qwen3-MoE flavors (tiny for tests; 30B-A3B as released: 128 experts, top-8, no shared
expert): core's decoder shapes, which the vlm stack composes too."""

from __future__ import annotations

from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.decoder_flavors import DECODER_FLAVORS

FLAVORS: dict[str, DecoderModelConfig] = DECODER_FLAVORS["qwen3_moe"]
"""The flavors by name (``model.flavor``)."""
