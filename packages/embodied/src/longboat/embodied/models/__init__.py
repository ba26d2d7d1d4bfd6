"""Embodied policies (one folder each exposing ``FAMILY``, found by core's family registry
through ``registry``) and their shared blocks (``common``, not a policy)."""

from longboat.embodied.models.common.freezing import apply_freezing
from longboat.embodied.models.common.init import init_weights
from longboat.embodied.models.family import PolicyFamily
from longboat.embodied.models.registry import (
    build_model,
    get_config,
    policy,
    policy_names,
    registered_models,
)

__all__ = [
    "PolicyFamily",
    "apply_freezing",
    "build_model",
    "get_config",
    "init_weights",
    "policy",
    "policy_names",
    "registered_models",
]
