"""The Wan 2.1 / 2.2 text-to-video DiT family (diffusers ``WanTransformer3DModel``).

The family package (``FAMILY``, on core's registry; ``longboat.diffusion.models.registry``):
``FLAVORS``, ``flavor(name)``, ``read_config(dir)``, ``build(cfg, *, precision, kernels)``,
``load_diffusers(model, cfg, dir)`` and ``save_diffusers(model, cfg, out_dir)``. The config
names import no megatron; the rest load ``model.py`` / ``diffusers.py`` on first use.
"""

from __future__ import annotations

import sys

from longboat.diffusion.models.common.family import lazy_attributes
from longboat.diffusion.models.registry import diffusion_family
from longboat.diffusion.models.wan.config import (
    DIFFUSERS_CLASS,
    FLAVORS,
    WanConfig,
    flavor,
    read_config,
)
from longboat.diffusion.models.wan.flops import flops_per_sample

_LAZY = {
    "WanModel": "longboat.diffusion.models.wan.model",
    "build": "longboat.diffusion.models.wan.model",
    "load_diffusers": "longboat.diffusion.models.wan.diffusers",
    "save_diffusers": "longboat.diffusion.models.wan.diffusers",
    "VideoPacking": "longboat.diffusion.models.wan.packing",
    "pack_latents": "longboat.diffusion.models.wan.packing",
    "unpack_tokens": "longboat.diffusion.models.wan.packing",
    "patchify": "longboat.diffusion.models.wan.packing",
    "unpatchify": "longboat.diffusion.models.wan.packing",
}


__getattr__ = lazy_attributes(__name__, _LAZY)

FAMILY = diffusion_family(
    "wan",
    sys.modules[__name__],
    flavors=FLAVORS,
    diffusers_classes=(DIFFUSERS_CLASS,),
    flops_per_sample=flops_per_sample,
    description="Wan 2.1 / 2.2 text-to-video DiT: 3D patches, AdaLN-modulated blocks with "
    "3D RoPE self-attention and UMT5 cross-attention",
)


__all__ = ["DIFFUSERS_CLASS", "FAMILY", "FLAVORS", "WanConfig", "flavor", "read_config", *_LAZY]
