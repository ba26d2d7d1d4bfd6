"""The diffusion families on core's registry: each folder of ``longboat.diffusion.models``
whose ``__init__`` exposes ``FAMILY = diffusion_family(...)`` is a family (``model.name``),
also found by a diffusers ``config.json``'s ``_class_name`` (``model.init_from``).

A family package (its ``__init__``, the implementation ``load()`` returns) provides
``FLAVORS`` and ``flavor(name) -> config``, ``read_config(dir) -> config`` (the architecture
of a diffusers directory), ``build(config, *, precision, kernels) -> model`` and
``load_diffusers(model, config, dir)`` / ``save_diffusers(model, config, out_dir)``; the
names beyond the config import megatron on first use.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.family import Family, family_for_checkpoint, find_family


@dataclass(frozen=True)
class DiffusersAdapter:
    """A diffusion family's weights to and from a diffusers directory (its package's
    ``read_config`` / ``load_diffusers`` / ``save_diffusers``)."""

    implementation: ModuleType
    format: str = "diffusers"

    def read_config(self, directory: str | Path) -> Any:
        """The architecture of a diffusers model directory."""
        return self.implementation.read_config(directory)

    def load(self, model: Any, config: Any, directory: str | Path) -> int:
        """Load the directory's weights into ``model``."""
        return self.implementation.load_diffusers(model, config, directory)

    def save(self, model: Any, config: Any, directory: str | Path) -> Path:
        """Write ``model`` as a directory diffusers loads."""
        return self.implementation.save_diffusers(model, config, directory)


@dataclass(frozen=True, kw_only=True)
class DiffusionFamily(Family):
    """A diffusion family: the core ``Family`` plus the package that implements it."""

    implementation: ModuleType
    """The family package (see the module doc)."""

    @property
    def diffusers_classes(self) -> tuple[str, ...]:
        """diffusers ``_class_name`` values of the checkpoints this family reads."""
        return self.checkpoint_types

    def load(self) -> ModuleType:
        """The family package."""
        return self.implementation


def _model_schema() -> type:
    from longboat.diffusion.train.schema import DiffusionModelConfig

    return DiffusionModelConfig


def diffusion_family(
    name: str,
    implementation: ModuleType,
    *,
    flavors: Mapping[str, Any],
    diffusers_classes: tuple[str, ...],
    description: str,
    flops_per_sample: Callable[..., float] | None = None,
) -> DiffusionFamily:
    """The ``DiffusionFamily`` of a family package (pass ``sys.modules[__name__]``)."""
    return DiffusionFamily(
        name=name,
        stack="diffusion",
        schema=_model_schema,
        flavors=flavors,
        description=description,
        build=lambda cfg, **options: implementation.build(cfg, **options),
        adapter=DiffusersAdapter(implementation),
        checkpoint_types=diffusers_classes,
        flops_per_sample=flops_per_sample,
        implementation=implementation,
    )


def get_family(name: str) -> DiffusionFamily:
    """The diffusion family ``name``; a ``ConfigError`` naming ``model.name`` otherwise."""
    return find_family("diffusion", name)


def family_of_diffusers_dir(path: str | Path) -> DiffusionFamily:
    """The family of a diffusers model directory (or a pipeline's ``transformer/``), from its
    ``config.json``'s ``_class_name``."""
    root = Path(path)
    file = root / "config.json"
    if not file.is_file() and (root / "transformer" / "config.json").is_file():
        file = root / "transformer" / "config.json"
    if not file.is_file():
        raise ConfigError(
            f"{file}: not found",
            key="model.init_from",
            fix="point at a diffusers model directory (or a pipeline directory with transformer/)",
        )
    class_name = json.loads(file.read_text()).get("_class_name")
    return family_for_checkpoint("diffusion", [class_name], key="model.init_from", where=str(file))


__all__ = [
    "DiffusionFamily",
    "diffusion_family",
    "family_of_diffusers_dir",
    "get_family",
]
