"""Llama 3 flavors (tiny for tests; 1B = Llama 3.2 1B, 8B / 70B = Llama 3.1): core's decoder
shapes, which the vlm stack composes too."""

from __future__ import annotations

from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.decoder_flavors import DECODER_FLAVORS

FLAVORS: dict[str, DecoderModelConfig] = DECODER_FLAVORS["llama3"]
"""The flavors by name (``model.flavor``)."""
