"""The VLM families: one module each, found by name (``model.name``) or by a Hugging Face
``config.json``'s ``model_type`` (``model.init_from``).

A family module (``longboat.vlm.models.<family>.model``) provides

- ``flavor(name) -> config`` and ``FLAVORS`` (the names it knows),
- ``read_hf_config(dir_or_dict) -> config`` (the architecture of a checkpoint),
- ``build(config, *, precision, device_type, kernels, recompute, vision_tensor_parallel)
  -> VisionLanguageModel`` (``VISION_DATA_PARALLEL = True`` where ``vision_tensor_parallel=1``
  under a TP decoder is supported),
- ``load_hf(model, config, dir)`` and ``save_hf(model, config, out_dir)``.

A config holds ``language`` (a core ``DecoderModelConfig``), ``vision`` (its tower's config
with ``patch_size``, ``spatial_merge_size``, ``temporal_patch_size``, ``depth`` and
``hidden_size``), the placeholder token ids and ``tokens_per_second``, plus
``architecture()`` and ``validate()``. Modules are imported on first use, so naming the
families imports no megatron.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from longboat.core.config.errors import ConfigError


@dataclass(frozen=True)
class VLMFamily:
    """One registered VLM family."""

    name: str
    module: str
    """The family module (see the module doc)."""
    hf_model_types: tuple[str, ...]
    """``config.json`` ``model_type`` values this family reads."""
    description: str

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


FAMILIES: dict[str, VLMFamily] = {}


def register(family: VLMFamily) -> VLMFamily:
    FAMILIES[family.name] = family
    return family


register(
    VLMFamily(
        name="qwen2_5_vl",
        module="longboat.vlm.models.qwen2_5_vl.model",
        hf_model_types=("qwen2_5_vl",),
        description="Qwen2.5-VL: window-attention ViT + patch merger + Qwen2 decoder, M-RoPE",
    )
)

register(
    VLMFamily(
        name="qwen3_vl",
        module="longboat.vlm.models.qwen3_vl.model",
        hf_model_types=("qwen3_vl",),
        description="Qwen3-VL (dense): ViT with deepstack mergers + Qwen3 decoder, interleaved "
        "M-RoPE, deepstack features added after the first decoder layers",
    )
)

register(
    VLMFamily(
        name="llava_onevision",
        module="longboat.vlm.models.llava_onevision.model",
        hf_model_types=("llava_onevision",),
        description="LLaVA-OneVision-style composition: SigLIP + projector + any core decoder, "
        "anyres tiling, 1D RoPE",
    )
)


def get_family(name: str) -> VLMFamily:
    """The family registered as ``name``; a ``ConfigError`` naming ``model.name`` otherwise."""
    if name not in FAMILIES:
        raise ConfigError(
            "unknown VLM family",
            key="model.name",
            value=name,
            fix=f"use one of {sorted(FAMILIES)}",
        )
    return FAMILIES[name]


def family_of_hf_dir(hf_dir: str | Path) -> VLMFamily:
    """The family of a Hugging Face directory, from its ``config.json``'s ``model_type``."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{path}: not found",
            key="model.init_from",
            fix="point at a Hugging Face vision-language model directory",
        )
    model_type = json.loads(path.read_text()).get("model_type")
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise ConfigError(
        f"{path}: model_type={model_type!r} is not a supported vision-language model",
        key="model.init_from",
        fix=f"longboat-vlm reads model_type {known}",
    )


__all__ = ["FAMILIES", "VLMFamily", "family_of_hf_dir", "get_family", "register"]
