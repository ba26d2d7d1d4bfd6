"""The VLM families on core's registry: each folder of ``longboat.vlm.models`` whose
``__init__`` exposes ``FAMILY = vlm_family(...)`` is a family (``model.name``), also found
by a Hugging Face ``config.json``'s ``model_type`` (``model.init_from``).

A family's implementation module (``load()``: its ``model.py``) provides

- ``flavor(name) -> config`` and ``FLAVORS`` (the names it knows),
- ``read_hf_config(dir_or_dict) -> config`` (the architecture of a checkpoint),
- ``build(config, *, precision, device_type, kernels, recompute, vision_tensor_parallel)
  -> VisionLanguageModel`` (``VISION_DATA_PARALLEL = True`` where ``vision_tensor_parallel=1``
  under a TP decoder is supported),
- ``load_hf(model, config, dir)`` and ``save_hf(model, config, out_dir)``,
- optionally ``PEFT_LAYOUT`` (a ``longboat.vlm.models.peft_layout.PeftLayout``) and
  ``visual_hf_state(model, config)`` (the tower and projector under ``transformers``' names),
  where a LoRA run's adapters can be written as a PEFT adapter.

A config holds ``language`` (a core ``DecoderModelConfig``), ``vision`` (its tower's config
with ``patch_size``, ``spatial_merge_size``, ``temporal_patch_size``, ``depth`` and
``hidden_size``), the placeholder token ids and ``tokens_per_second``, plus
``architecture()`` and ``validate()``. The implementation is imported on first use, so
listing the families imports no megatron.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.family import Family, LazyFlavors, family_for_checkpoint, find_family


@dataclass(frozen=True)
class HFImplementationAdapter:
    """A VLM family's weights to and from a Hugging Face directory (its module's
    ``read_hf_config`` / ``load_hf`` / ``save_hf``)."""

    implementation: Callable[[], ModuleType]
    format: str = "hf"

    def read_config(self, directory: str | Path) -> Any:
        """The model config of ``<directory>/config.json``."""
        return self.implementation().read_hf_config(directory)

    def load(self, model: Any, config: Any, directory: str | Path) -> int:
        """Load the directory's weights into ``model``."""
        return self.implementation().load_hf(model, config, directory)

    def save(self, model: Any, config: Any, directory: str | Path) -> Path:
        """Write ``model`` as a directory ``transformers`` loads (collective)."""
        return self.implementation().save_hf(model, config, directory)


@dataclass(frozen=True, kw_only=True)
class VLMFamily(Family):
    """A VLM family: the core ``Family`` plus the module that implements it."""

    implementation: Callable[[], ModuleType]
    """Imports and returns the family's implementation module (see the module doc)."""

    @property
    def hf_model_types(self) -> tuple[str, ...]:
        """``config.json`` ``model_type`` values this family reads."""
        return self.checkpoint_types

    def load(self) -> ModuleType:
        """The implementation module (imported now)."""
        return self.implementation()


def vlm_family(
    name: str,
    *,
    implementation: Callable[[], ModuleType],
    flavors: tuple[str, ...],
    hf_model_types: tuple[str, ...],
    description: str,
    flops_per_sample: Callable[..., float] | None = None,
) -> VLMFamily:
    """The ``VLMFamily`` of an implementation module with the given flavor names."""
    from longboat.vlm.train.schema import VLMModelConfig

    return VLMFamily(
        name=name,
        stack="vlm",
        schema=VLMModelConfig,
        flavors=LazyFlavors(flavors, lambda flavor: implementation().flavor(flavor)),
        description=description,
        build=lambda cfg, **options: implementation().build(cfg, **options),
        adapter=HFImplementationAdapter(implementation),
        checkpoint_types=hf_model_types,
        flops_per_sample=flops_per_sample,
        implementation=implementation,
    )


def get_family(name: str) -> VLMFamily:
    """The VLM family ``name``; a ``ConfigError`` naming ``model.name`` otherwise."""
    return find_family("vlm", name)


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
    return family_for_checkpoint("vlm", [model_type], key="model.init_from", where=str(path))


__all__ = ["VLMFamily", "family_of_hf_dir", "get_family", "vlm_family"]
