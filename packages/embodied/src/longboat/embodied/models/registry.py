"""Policy registry: every policy folder's ``POLICY`` (a ``family.PolicyFamily``), found by
convention, and ``build_model(name, flavor)``.

Policies are found, never listed here:

- every subpackage of ``longboat.embodied.models`` whose ``__init__`` sets ``POLICY``;
- every sub-folder with an ``__init__.py`` of the folders on ``LONGBOAT_FAMILY_PATH``
  (``os.pathsep``-separated), imported by file location; such a folder's ``conf/`` holds
  its YAMLs (``conf/model/<option>.yaml``), which core's config composition adds to the
  search path;
- the ``longboat.families`` entry point group of installed packages (name = ``model.name``,
  value = ``"package.module:POLICY"``; entries that are not policies are skipped).

A policy's name is its folder's (or entry point's) name, so the names are known without
importing anything; a policy is imported when it is first used.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from longboat.core.config.errors import ConfigError
from longboat.core.config.suggest import did_you_mean
from longboat.embodied.models.family import PolicyFamily

POLICY_ATTR = "POLICY"
"""The module-level name a policy package binds its ``PolicyFamily`` to."""
FAMILY_PATH_ENV = "LONGBOAT_FAMILY_PATH"
"""Folders (``os.pathsep``-separated) whose sub-folders are policy packages."""
ENTRY_POINT_GROUP = "longboat.families"
"""Entry point group of families in installed packages."""
_BUILTIN_PACKAGE = "longboat.embodied.models"
_PATH_PACKAGE = "longboat_family_path"
"""Parent name family-path packages are imported under (``longboat_family_path.<name>``)."""


def family_path_dirs() -> list[Path]:
    """The existing folders on ``LONGBOAT_FAMILY_PATH``, in order."""
    raw = os.environ.get(FAMILY_PATH_ENV, "")
    return [Path(p) for p in raw.split(os.pathsep) if p and Path(p).is_dir()]


def _builtin_names() -> list[str]:
    models = importlib.import_module(_BUILTIN_PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(models.__path__) if m.ispkg)


def _path_packages() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in family_path_dirs():
        for sub in sorted(folder.iterdir()):
            if (sub / "__init__.py").is_file() and sub.name.isidentifier():
                found.setdefault(sub.name, sub)
    return found


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def candidate_names() -> list[str]:
    """Names that may be policies (folder and entry point names), found without importing
    anything; ``policy_names()`` keeps those that are."""
    return sorted({*_builtin_names(), *_path_packages(), *_entry_points()})


def _import_path_package(name: str, folder: Path) -> Any:
    full = f"{_PATH_PACKAGE}.{name}"
    if full in sys.modules:
        return sys.modules[full]
    if _PATH_PACKAGE not in sys.modules:
        parent = importlib.util.module_from_spec(
            importlib.machinery.ModuleSpec(_PATH_PACKAGE, None, is_package=True)
        )
        parent.__path__ = []
        sys.modules[_PATH_PACKAGE] = parent
    spec = importlib.util.spec_from_file_location(
        full, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full]
        raise
    return module


@cache
def _load(name: str, source: str) -> PolicyFamily | None:
    """The policy of one candidate (``source`` keys the cache on where it comes from)."""
    if name in _builtin_names():
        obj = getattr(importlib.import_module(f"{_BUILTIN_PACKAGE}.{name}"), POLICY_ATTR, None)
    elif name in (path := _path_packages()):
        obj = getattr(_import_path_package(name, path[name]), POLICY_ATTR, None)
    elif name in (eps := _entry_points()):
        obj = eps[name].load()
    else:
        return None
    if not isinstance(obj, PolicyFamily):
        return None
    if obj.name != name:
        raise ConfigError(
            f"the policy found as {name!r} ({source}) calls itself {obj.name!r}",
            key="model.name",
            value=name,
            fix=f"name the PolicyFamily after its folder or entry point: name={name!r}",
        )
    return obj


def _source(name: str) -> str:
    if name in _builtin_names():
        return f"{_BUILTIN_PACKAGE}.{name}"
    path = _path_packages()
    if name in path:
        return str(path[name])
    return f"entry point {ENTRY_POINT_GROUP}:{name}"


def find_policy(name: str) -> PolicyFamily | None:
    """The policy called ``name``, or None."""
    if name not in candidate_names():
        return None
    return _load(name, _source(name))


def policy_names() -> list[str]:
    """Names of every policy found (imports each candidate). A candidate that cannot be
    imported here (e.g. a family of another stack on ``LONGBOAT_FAMILY_PATH``, needing what
    this install lacks) is not listed; naming it (``policy``) shows its error."""
    names = []
    for name in candidate_names():
        try:
            found = find_policy(name)
        except ImportError:
            continue
        if found is not None:
            names.append(name)
    return names


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
    for name in policy_names():
        family = find_policy(name)
        if family is not None and isinstance(cfg, family.config_class):
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
