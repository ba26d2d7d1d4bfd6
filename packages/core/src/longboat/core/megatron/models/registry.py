"""Decoder family registry: ``@register_family`` makes a family reachable by name (the
llm stack's models and every VLM's language model)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.models.common import dense_layer_spec
from longboat.core.megatron.models.config import DecoderModelConfig


@dataclass(frozen=True)
class ModelFamily:
    """Everything longboat knows about one model family."""

    name: str
    """Registry name (``model.name``)."""
    flavors: dict[str, DecoderModelConfig]
    """Size flavors; ``tiny`` always exists."""
    hf_model_types: tuple[str, ...]
    """HF ``config.json`` ``model_type`` values this family reads."""
    from_hf_config: Callable[[dict[str, Any]], DecoderModelConfig]
    """HF config.json dict -> model config."""
    to_hf_config: Callable[[DecoderModelConfig], Any]
    """Model config -> a ``transformers`` config object (``save_pretrained`` writes it)."""
    hf_architectures: tuple[str, ...] = ()
    """HF ``architectures`` class names of this family (used when ``model_type`` is absent
    or unknown)."""
    hf_prefix: str = "model."
    """Prefix of the decoder tensors in the HF state dict."""
    layer_spec: Callable[..., Any] = dense_layer_spec
    """``layer_spec(cfg, backend, kernels)`` -> megatron ``ModuleSpec`` of one decoder layer
    (the shared Llama-style layer; qk-norm and MoE read from the config)."""
    notes: dict[str, str] = field(default_factory=dict)

    def flavor(self, name: str) -> DecoderModelConfig:
        """A copy of flavor ``name``; ConfigError listing the flavors otherwise."""
        if name not in self.flavors:
            raise ConfigError(
                f"model.flavor={name!r}: family {self.name!r} has flavors "
                f"{sorted(self.flavors)}. Fix: pick one of them."
            )
        return dataclasses.replace(self.flavors[name])


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(factory: Callable[[], ModelFamily]) -> Callable[[], ModelFamily]:
    """Decorator: call ``factory`` and register the ``ModelFamily`` it returns."""
    family = factory()
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered twice")
    if "tiny" not in family.flavors:
        raise ValueError(f"model family {family.name!r} has no 'tiny' flavor")
    _FAMILIES[family.name] = family
    return factory


def get_family(name: str) -> ModelFamily:
    """The registered family ``name``."""
    _load_builtin()
    if name not in _FAMILIES:
        raise ConfigError(
            f"model.name={name!r}: unknown model family. Fix: use one of {sorted(_FAMILIES)}."
        )
    return _FAMILIES[name]


def list_families() -> list[str]:
    """Names of every registered family."""
    _load_builtin()
    return sorted(_FAMILIES)


def family_for_hf_config(hf_config: dict[str, Any]) -> ModelFamily:
    """The family of an HF ``config.json``: by ``model_type``, else by ``architectures``."""
    _load_builtin()
    model_type = hf_config.get("model_type")
    for fam in _FAMILIES.values():
        if model_type in fam.hf_model_types:
            return fam
    archs = set(hf_config.get("architectures") or ())
    for fam in _FAMILIES.values():
        if archs & set(fam.hf_architectures):
            return fam
    known = sorted(t for f in _FAMILIES.values() for t in f.hf_model_types)
    raise ConfigError(
        f"config.json model_type={model_type!r} is not supported (architectures: {sorted(archs)})",
        fix=f"use a checkpoint of one of {known}",
    )


def _load_builtin() -> None:
    # Importing the family packages runs their @register_family decorators.
    from longboat.core.megatron.models import llama3, qwen2, qwen3, qwen3_moe  # noqa: F401
