"""Merge a composed (untyped) config onto the typed schema, collecting every problem.

OmegaConf's own ``merge`` stops at the first bad key. Here each key is assigned
to the typed node one by one so that all unknown keys (with a did-you-mean) and
all type errors are reported together, using OmegaConf's own conversion rules
(``"3"`` -> 3 for an int field, interpolations allowed anywhere).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from longboat.core.config.errors import ProblemCollector
from longboat.core.config.suggest import close_matches


def type_name(tp: Any) -> str:
    """Readable name of a schema type: ``int``, ``list[float]``, ``OptimConfig``."""
    if tp is Any:
        return "Any"
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin is None:
        return getattr(tp, "__name__", str(tp))
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    base = getattr(origin, "__name__", str(origin))
    return f"{base}[{', '.join(type_name(a) for a in args)}]"


def _expected(node: DictConfig, key: str) -> str:
    child = node._get_node(key)
    if child is None:
        return "Any"
    meta = child._metadata
    name = type_name(meta.ref_type)
    if meta.optional and "None" not in name and name != "Any":
        name += " | None"
    return name


def _is_structured(node: Any) -> bool:
    return isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node))


def _is_closed(node: DictConfig) -> bool:
    """True when new keys are rejected (structured and in struct mode)."""
    return _is_structured(node) and OmegaConf.is_struct(node) is not False


def leaf_paths(node: Any, prefix: str = "") -> Iterator[str]:
    """Every dotted key path under ``node`` (containers and leaves)."""
    if isinstance(node, DictConfig | Mapping):
        for k in node if isinstance(node, Mapping) else node.keys():
            path = f"{prefix}.{k}" if prefix else str(k)
            yield path
            child = node._get_node(k) if isinstance(node, DictConfig) else node[k]
            if isinstance(child, DictConfig | Mapping):
                yield from leaf_paths(child, path)


def _flatten(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}")
    else:
        yield prefix, value


def _keys(node: DictConfig) -> list[str]:
    """All keys of ``node``; unlike ``key in node`` this includes ``???`` (missing) values."""
    return [str(k) for k in node.keys()]  # noqa: SIM118 (DictConfig.__contains__ differs)


def _guesses(root: DictConfig, node: DictConfig, path: str, key: str) -> list[str]:
    """Full paths the user probably meant by ``path`` (the unknown ``key`` of ``node``)."""
    parent = path.rpartition(".")[0]
    guesses = [f"{parent}.{m}" if parent else m for m in close_matches(key, _keys(node))]
    if guesses:
        return guesses
    # The key may sit in the wrong group (train.lr instead of optim.lr).
    everywhere = list(leaf_paths(root))
    guesses = [p for p in everywhere if p.rpartition(".")[2] == key]
    if not guesses:
        by_leaf: dict[str, list[str]] = {}
        for p in everywhere:
            by_leaf.setdefault(p.rpartition(".")[2], []).append(p)
        for leaf in close_matches(key, list(by_leaf)):
            guesses += by_leaf[leaf]
    return guesses[:3]


def _unknown_key_fix(guesses: list[str], node: DictConfig, path: str) -> str:
    parent = path.rpartition(".")[0]
    where = f"under {parent}" if parent else "at the top level"
    valid = ", ".join(sorted(_keys(node)))
    hint = f"did you mean {' or '.join(repr(g) for g in guesses)}? " if guesses else ""
    return f"{hint}(valid keys {where}: {valid})"


def merge_checked(
    root: DictConfig,
    data: Mapping[str, Any],
    problems: ProblemCollector,
    bad_keys: set[str],
    *,
    node: DictConfig | None = None,
    prefix: str = "",
) -> None:
    """Assign ``data`` onto the typed ``node`` (default ``root``), key by key.

    Unknown keys and values of the wrong type are added to ``problems`` (their paths
    to ``bad_keys``) and skipped; everything valid is written.
    """
    node = root if node is None else node
    for raw_key, value in data.items():
        key = str(raw_key)
        path = f"{prefix}.{key}" if prefix else key
        known = key in _keys(node)
        if not known and _is_closed(node):
            # Report the leaf paths the user wrote (trian.steps, not just trian).
            guesses = _guesses(root, node, path, key)
            for leaf, leaf_value in _flatten(value, path):
                suffix = leaf[len(path) :]
                problems.add(
                    leaf,
                    "unknown key",
                    value=leaf_value,
                    fix=_unknown_key_fix([g + suffix for g in guesses], node, path),
                )
                bad_keys.add(leaf)
            continue
        child = node._get_node(key) if known else None
        if _is_structured(child) and isinstance(value, Mapping):
            merge_checked(root, value, problems, bad_keys, node=child, prefix=path)
            continue
        try:
            if _loose_bool(child, value):
                raise ValidationError("int/str for a bool field")
            node[key] = value
        except OmegaConfBaseException:
            expected = _expected(node, key)
            shown = value
            problems.add(
                path,
                f"expected {expected}, got {type(value).__name__}",
                value=shown,
                fix=f"set {path} to a value of type {expected}",
            )
            bad_keys.add(path)


def _loose_bool(child: Any, value: Any) -> bool:
    """True for a non-bool assigned to a bool field (OmegaConf would turn 3 or "yes" into True)."""
    if child is None or child._metadata.ref_type is not bool or isinstance(value, bool):
        return False
    if value is None:
        return False  # None is checked by OmegaConf against the field's optionality
    return not (isinstance(value, str) and value.startswith("${"))


def missing_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Full paths of mandatory values (``???``) still unset, in schema order.

    Walks nodes without resolving interpolations (``OmegaConf.missing_keys`` resolves
    them and would raise on a bad one before it can be reported properly).
    """
    found: list[str] = []
    for key in _keys(cfg):
        child = cfg._get_node(key)
        path = f"{prefix}.{key}" if prefix else key
        if child is None or child._is_interpolation():
            continue
        if child._is_missing():
            found.append(path)
        elif isinstance(child, DictConfig) and not child._is_none():
            found += missing_keys(child, path)
    return found


def unresolvable(cfg: DictConfig, prefix: str = "") -> list[tuple[str, str]]:
    """(path, reason) of every ``${...}`` that does not resolve to a valid value."""
    found: list[tuple[str, str]] = []
    for key in _keys(cfg):
        child = cfg._get_node(key)
        path = f"{prefix}.{key}" if prefix else key
        if child is None:
            continue
        if child._is_interpolation():
            try:
                cfg[key]
            except OmegaConfBaseException as exc:
                found.append((path, str(exc).splitlines()[0]))
        elif isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            found += unresolvable(child, path)
    return found


def to_plain(cfg: DictConfig | ListConfig) -> Any:
    """The config as plain dicts/lists with interpolations left as strings."""
    return OmegaConf.to_container(cfg, resolve=False)


__all__ = [
    "leaf_paths",
    "merge_checked",
    "missing_keys",
    "to_plain",
    "type_name",
    "unresolvable",
]
