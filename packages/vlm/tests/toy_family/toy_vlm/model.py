"""The toy VLM's implementation: Qwen2.5-VL's modules and conversion at its own size (a
2-layer decoder under the tiny tower)."""

from __future__ import annotations

import dataclasses
from typing import Any

from longboat.vlm.models.qwen2_5_vl import model as qwen2_5_vl

FLAVORS = ("tiny",)
VISION_DATA_PARALLEL = qwen2_5_vl.VISION_DATA_PARALLEL
read_hf_config = qwen2_5_vl.read_hf_config
load_hf = qwen2_5_vl.load_hf
save_hf = qwen2_5_vl.save_hf

BUILT: list[Any] = []
"""Configs this family built (the test reads it)."""


def flavor(name: str) -> Any:
    """The toy's only flavor, ``tiny``."""
    if name != "tiny":
        raise KeyError(name)
    base = qwen2_5_vl.flavor("tiny")
    return dataclasses.replace(base, language=dataclasses.replace(base.language, num_layers=2))


def build(cfg: Any, **options: Any) -> Any:
    """Qwen2.5-VL's build of ``cfg``."""
    BUILT.append(cfg)
    return qwen2_5_vl.build(cfg, **options)
