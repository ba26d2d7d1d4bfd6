"""The FLUX.1 image MMDiT family (diffusers ``FluxTransformer2DModel``).

The family package (``FAMILY``, on core's registry; ``longboat.diffusion.models.registry``):
``FLAVORS``, ``flavor(name)``, ``read_config(dir)``, ``build(cfg, *, precision, kernels)``,
``load_diffusers(model, cfg, dir)`` and ``save_diffusers(model, cfg, out_dir)``. The config
names import no megatron; the rest load ``model.py`` / ``diffusers.py`` on first use.
"""

from __future__ import annotations

import sys

from longboat.diffusion.models.common.family import lazy_attributes
from longboat.diffusion.models.flux.config import (
    DIFFUSERS_CLASS,
    FLAVORS,
    FluxConfig,
    flavor,
    read_config,
)
from longboat.diffusion.models.registry import diffusion_family

_LAZY = {
    "FluxModel": "longboat.diffusion.models.flux.model",
    "build": "longboat.diffusion.models.flux.model",
    "rope_tables": "longboat.diffusion.models.flux.model",
    "load_diffusers": "longboat.diffusion.models.flux.diffusers",
    "save_diffusers": "longboat.diffusion.models.flux.diffusers",
}


__getattr__ = lazy_attributes(__name__, _LAZY)

FAMILY = diffusion_family(
    "flux",
    sys.modules[__name__],
    flavors=FLAVORS,
    diffusers_classes=(DIFFUSERS_CLASS,),
    description="FLUX.1 text-to-image MMDiT: 2x2 latent patches, double-stream (image / "
    "text) and single-stream blocks with joint attention, 3-axis RoPE, T5 tokens + CLIP "
    "pooled text + timestep (+ guidance) conditioning",
)


__all__ = ["DIFFUSERS_CLASS", "FAMILY", "FLAVORS", "FluxConfig", "flavor", "read_config", *_LAZY]
