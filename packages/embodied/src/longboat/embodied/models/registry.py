"""Model registry: ``@register_model("name")`` on a model class, ``build_model(name, flavor)``.

A registered class carries ``config_class`` (a dataclass with a ``FLAVORS`` mapping of
flavor name -> zero-argument factory) and is built as ``cls(config)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import torch
from torch import nn


class _RegisteredModel(Protocol):
    config_class: Any

    def __call__(self, config: Any) -> nn.Module: ...


_REGISTRY: dict[str, Any] = {}
T = TypeVar("T", bound=type)


def register_model(name: str) -> Callable[[T], T]:
    """Class decorator registering a model family under ``name``."""

    def deco(cls: T) -> T:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"model name {name!r} is already registered to {_REGISTRY[name]}")
        if not hasattr(cls, "config_class"):
            raise TypeError(f"{cls.__name__} needs a 'config_class' attribute to be registered")
        _REGISTRY[name] = cls
        return cls

    return deco


def _ensure_builtin_models() -> None:
    # Importing the families runs their decorators; kept lazy so ``registry`` stays cheap.
    from longboat.embodied.models import groot_n1_6, pi05  # noqa: F401


def registered_models() -> list[str]:
    """Names of every registered model family."""
    _ensure_builtin_models()
    return sorted(_REGISTRY)


def model_class(name: str) -> Any:
    """The class registered under ``name``."""
    _ensure_builtin_models()
    if name not in _REGISTRY:
        raise KeyError(f"model.name={name!r} is not registered; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def get_config(name: str, flavor: str, overrides: Mapping[str, Any] | None = None) -> Any:
    """The config of ``name``/``flavor`` with dotted-key ``overrides`` (e.g.
    ``{"dit.dropout": 0.0}``) applied together, then validated once."""
    cls = model_class(name)
    flavors = cls.config_class.FLAVORS
    if flavor not in flavors:
        raise KeyError(
            f"model.flavor={flavor!r} is not a flavor of {name!r}; choose one of {sorted(flavors)}"
        )
    return apply_overrides(flavors[flavor](), overrides or {})


def apply_overrides(cfg: Any, overrides: Mapping[str, Any]) -> Any:
    """Return ``cfg`` with dotted-key overrides; each dataclass is rebuilt once with all of
    its changes, so interdependent keys (e.g. vocab size and a token id) can change together."""
    tree: dict[str, Any] = {}
    for key, value in overrides.items():
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise KeyError(f"override key {key!r} conflicts with another override of {part!r}")
        node[parts[-1]] = value
    return _apply_tree(cfg, tree, "")


def _apply_tree(obj: Any, tree: dict[str, Any], prefix: str) -> Any:
    changes = {}
    for field, value in tree.items():
        if not dataclasses.is_dataclass(obj) or field not in {
            f.name for f in dataclasses.fields(obj)
        }:
            raise KeyError(
                f"override key {prefix + field!r}: {field!r} is not a field of {type(obj).__name__}"
            )
        if isinstance(value, dict) and dataclasses.is_dataclass(getattr(obj, field)):
            value = _apply_tree(getattr(obj, field), value, f"{prefix}{field}.")
        changes[field] = value
    return dataclasses.replace(obj, **changes) if changes else obj


def build_model(
    name: str,
    flavor_or_config: Any = "tiny",
    *,
    overrides: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Build a registered model from a flavor name or a config instance.

    ``device="meta"`` builds without allocating (parameter counting, deferred init)."""
    cls = model_class(name)
    if isinstance(flavor_or_config, str):
        cfg = get_config(name, flavor_or_config, overrides)
    else:
        if not isinstance(flavor_or_config, cls.config_class):
            raise TypeError(
                f"build_model({name!r}, ...) needs a flavor name or a {cls.config_class.__name__}, "
                f"got {type(flavor_or_config).__name__}"
            )
        cfg = apply_overrides(flavor_or_config, overrides or {})
    if device is None:
        return cls(cfg)
    with torch.device(device):
        return cls(cfg)
