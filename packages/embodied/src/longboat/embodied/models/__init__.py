"""Embodied model families (GR00T N1.6, pi0.5) and their shared blocks."""

from longboat.embodied.models.common.freezing import apply_freezing
from longboat.embodied.models.common.init import init_weights
from longboat.embodied.models.registry import (
    build_model,
    get_config,
    register_model,
    registered_models,
)

__all__ = [
    "apply_freezing",
    "build_model",
    "get_config",
    "init_weights",
    "register_model",
    "registered_models",
]
