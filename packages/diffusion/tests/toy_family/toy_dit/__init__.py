"""A toy diffusion family kept outside the diffusion package (tests/toy_family, found through
``LONGBOAT_FAMILY_PATH``): Wan's DiT blocks at a one-block size, written the way a user adds a
family without editing longboat."""

from __future__ import annotations

import sys
from typing import Any

from longboat.diffusion.models import wan
from longboat.diffusion.models.registry import diffusion_family

FLAVORS = {
    "tiny": wan.WanConfig(
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=16,
        ffn_dim=32,
        text_dim=32,
        freq_dim=32,
    )
}
BUILT: list[Any] = []
"""Configs this family built (the test reads it)."""


def flavor(name: str) -> Any:
    """The toy's only flavor, ``tiny``."""
    return FLAVORS[name]


def read_config(path: Any) -> Any:
    """A diffusers directory's Wan config."""
    return wan.read_config(path)


def build(cfg: Any, **options: Any) -> Any:
    """Wan's build of ``cfg``."""
    BUILT.append(cfg)
    return wan.build(cfg, **options)


def load_diffusers(*args: Any, **kwargs: Any) -> Any:
    """Wan's diffusers reader."""
    return wan.load_diffusers(*args, **kwargs)


def save_diffusers(*args: Any, **kwargs: Any) -> Any:
    """Wan's diffusers writer."""
    return wan.save_diffusers(*args, **kwargs)


FAMILY = diffusion_family(
    "toy_dit",
    sys.modules[__name__],
    flavors=FLAVORS,
    diffusers_classes=("ToyDiT",),
    description="toy DiT: one Wan block (a test family)",
)
