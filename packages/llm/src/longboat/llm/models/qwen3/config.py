"""Qwen3 dense flavors (tiny for tests; the real 0.6B / 1.7B tie embeddings, 8B / 32B do not):
core's decoder shapes, which the vlm stack composes too."""

from __future__ import annotations

from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.decoder_flavors import DECODER_FLAVORS

FLAVORS: dict[str, DecoderModelConfig] = DECODER_FLAVORS["qwen3"]
"""The flavors by name (``model.flavor``)."""
