"""Policy registry: the embodied families of core's registry (``longboat.core.family``),
looked up by ``model.name``, and ``build_model(name, flavor)``.

Policies are found by core, never listed here: each subpackage of
``longboat.embodied.models`` exposing ``FAMILY`` (a ``family.PolicyFamily``), the
``longboat.families`` entry points and the folders on ``LONGBOAT_FAMILY_PATH``, keeping those
whose ``stack`` is ``embodied``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from longboat.core.config.errors import ConfigError
from longboat.core.config.suggest import did_you_mean
from longboat.core.family import families
from longboat.embodied.models.family import PolicyFamily

STACK = "embodied"
"""The stack whose families are policies."""


def _policies() -> dict[str, PolicyFamily]:
    found = families(STACK)
    return {n: f for n, f in found.items() if isinstance(f, PolicyFamily)}


def find_policy(name: str) -> PolicyFamily | None:
    """The policy called ``name``, or None."""
    return _policies().get(name)


def policy_names() -> list[str]:
    """Names of every policy found, sorted."""
    return sorted(_policies())


class UnknownPolicyError(ConfigError, KeyError):
    """``model.name`` names no policy (a ConfigError, and a KeyError for lookups)."""

    __str__ = ConfigError.__str__


def policy(name: str) -> PolicyFamily:
    """The policy called ``name``; unknown names are a ConfigError with a did-you-mean."""
    found = find_policy(name)
    if found is None:
        raise UnknownPolicyError(
            "is not registered as an embodied policy",
            key="model.name",
            value=name,
            fix=did_you_mean(name, policy_names(), what="policies"),
        )
    return found


def policy_of_config(cfg: Any) -> PolicyFamily:
    """The policy whose config class ``cfg`` is an instance of."""
    for family in _policies().values():
        if isinstance(cfg, family.config_class):
            return family
    raise TypeError(f"{type(cfg).__name__} is the config of no embodied policy")


def registered_models() -> list[str]:
    """Names of every policy found (``policy_names``)."""
    return policy_names()


def model_class(name: str) -> Any:
    """The model class of the policy ``name``."""
    return policy(name).model_class


def get_config(name: str, flavor: str, overrides: Mapping[str, Any] | None = None) -> Any:
    """The config of ``name``/``flavor`` with dotted-key ``overrides`` (e.g.
    ``{"dit.dropout": 0.0}``) applied together, then validated once."""
    flavors = policy(name).flavors
    if flavor not in flavors:
        raise KeyError(
            f"model.flavor={flavor!r} is not a flavor of {name!r}; choose one of {sorted(flavors)}"
        )
    return apply_overrides(flavors[flavor], overrides or {})


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
    """Build a policy from a flavor name or a config instance.

    ``device="meta"`` builds without allocating (parameter counting, deferred init)."""
    family = policy(name)
    if isinstance(flavor_or_config, str):
        cfg = get_config(name, flavor_or_config, overrides)
    else:
        if not isinstance(flavor_or_config, family.config_class):
            raise TypeError(
                f"build_model({name!r}, ...) needs a flavor name or a "
                f"{family.config_class.__name__}, got {type(flavor_or_config).__name__}"
            )
        cfg = apply_overrides(flavor_or_config, overrides or {})
    if device is None:
        return family.build(cfg)
    with torch.device(device):
        return family.build(cfg)
