"""Decoder families every Megatron stack shares (one folder each: ``flavors.py``, ``hf.py``,
``README.md``, registered in its ``__init__``): the llm stack's models and the language
models of the vlm stack. ``DecoderModelConfig`` is their model config."""

from longboat.core.megatron.models.config import ARCH_FIELDS, DecoderModelConfig
from longboat.core.megatron.models.registry import (
    ModelFamily,
    family_for_hf_config,
    get_family,
    list_families,
    register_family,
)

__all__ = [
    "ARCH_FIELDS",
    "DecoderModelConfig",
    "ModelFamily",
    "family_for_hf_config",
    "get_family",
    "list_families",
    "register_family",
]
