"""The FLUX.1 image MMDiT family (diffusers ``FluxTransformer2DModel``).

The family interface the registry hands out (``longboat.diffusion.models.registry``):
``FLAVORS``, ``flavor(name)``, ``read_config(dir)``, ``build(cfg, *, precision, kernels)``,
``load_diffusers(model, cfg, dir)`` and ``save_diffusers(model, cfg, out_dir)``. The config
names import no megatron; the rest load ``model.py`` / ``hf.py`` on first use.
"""

from __future__ import annotations

from longboat.diffusion.models.common.family import lazy_attributes
from longboat.diffusion.models.flux.config import (
    DIFFUSERS_CLASS,
    FLAVORS,
    FluxConfig,
    flavor,
    read_config,
)

_LAZY = {
    "FluxModel": "longboat.diffusion.models.flux.model",
    "build": "longboat.diffusion.models.flux.model",
    "rope_tables": "longboat.diffusion.models.flux.model",
    "load_diffusers": "longboat.diffusion.models.flux.hf",
    "save_diffusers": "longboat.diffusion.models.flux.hf",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = ["DIFFUSERS_CLASS", "FLAVORS", "FluxConfig", "flavor", "read_config", *_LAZY]
