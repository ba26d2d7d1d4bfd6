"""The diffusion model families: one module each, found by name (``model.name``) or by a
diffusers ``config.json``'s ``_class_name`` (``model.init_from``).

A family module (``longboat.diffusion.models.<family>``) provides ``FLAVORS`` and
``flavor(name) -> config``, ``read_config(dir) -> config`` (the architecture of a diffusers
directory), ``build(config, *, precision, kernels) -> model`` and ``load_diffusers(model,
config, dir)`` / ``save_diffusers(model, config, out_dir)``. Modules are imported on first use,
so naming the families imports no megatron.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from longboat.core.config.errors import ConfigError


@dataclass(frozen=True)
class DiffusionFamily:
    """One registered model family."""

    name: str
    """Registry name (``model.name``)."""
    module: str
    """The family module (see the module doc)."""
    diffusers_classes: tuple[str, ...]
    """diffusers ``_class_name`` values of the checkpoints this family reads."""
    description: str

    def load(self) -> ModuleType:
        """The family module (imported now)."""
        return importlib.import_module(self.module)


FAMILIES: dict[str, DiffusionFamily] = {}


def register(family: DiffusionFamily) -> DiffusionFamily:
    """Make ``family`` reachable by name and by its diffusers class names."""
    if family.name in FAMILIES:
        raise ValueError(f"diffusion family {family.name!r} is registered twice")
    FAMILIES[family.name] = family
    return family


register(
    DiffusionFamily(
        name="wan",
        module="longboat.diffusion.models.wan",
        diffusers_classes=("WanTransformer3DModel",),
        description="Wan 2.1 / 2.2 text-to-video DiT: 3D patches, AdaLN-modulated blocks with "
        "3D RoPE self-attention and UMT5 cross-attention",
    )
)
register(
    DiffusionFamily(
        name="flux",
        module="longboat.diffusion.models.flux",
        diffusers_classes=("FluxTransformer2DModel",),
        description="FLUX.1 text-to-image MMDiT: 2x2 latent patches, double-stream (image / "
        "text) and single-stream blocks with joint attention, 3-axis RoPE, T5 tokens + CLIP "
        "pooled text + timestep (+ guidance) conditioning",
    )
)


def get_family(name: str) -> DiffusionFamily:
    """The family registered as ``name``; a ``ConfigError`` naming ``model.name`` otherwise."""
    if name not in FAMILIES:
        raise ConfigError(
            "unknown diffusion model family",
            key="model.name",
            value=name,
            fix=f"use one of {sorted(FAMILIES)}",
        )
    return FAMILIES[name]


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
    for family in FAMILIES.values():
        if class_name in family.diffusers_classes:
            return family
    known = sorted(c for f in FAMILIES.values() for c in f.diffusers_classes)
    raise ConfigError(
        f"{file}: _class_name={class_name!r} is not a supported diffusion transformer",
        key="model.init_from",
        fix=f"longboat-diffusion reads {known}",
    )


__all__ = ["FAMILIES", "DiffusionFamily", "family_of_diffusers_dir", "get_family", "register"]
