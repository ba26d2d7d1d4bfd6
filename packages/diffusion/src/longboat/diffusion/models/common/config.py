"""What the families' configs share: the diffusers directory lookup, ``config.json`` reading,
flavor lookup, activation-recompute settings and tensor-parallel checks (no megatron)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Self

from longboat.core.config.errors import ConfigError, ConfigProblem


class DiTConfigBase:
    """Methods every family config (a frozen dataclass with ``num_blocks`` and
    ``recompute_blocks``) shares."""

    num_blocks: int
    recompute_blocks: int

    def num_recomputed(self) -> int:
        """How many blocks (from the first) recompute their activations."""
        if self.recompute_blocks < 0:
            return self.num_blocks
        return min(self.recompute_blocks, self.num_blocks)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def recompute_problem(self, prefix: str) -> ConfigProblem | None:
        """The problem with ``recompute_blocks`` (an integer >= -1), None when it is valid."""
        value = self.recompute_blocks
        if isinstance(value, bool) or not isinstance(value, int):
            message = "must be an integer."
        elif value < -1:
            message = "must be >= -1."
        else:
            return None
        return ConfigProblem(
            key=f"{prefix}.recompute_blocks",
            message=message,
            value=value,
            fix="use 0 (none), n or -1 (all).",
        )


def tensor_parallel_problems(
    widths: Mapping[str, int], tensor_parallel: int, *, prefix: str, fix: str
) -> list[ConfigProblem]:
    """One problem per ``widths`` entry (config key -> size) that ``tensor_parallel`` does not
    divide."""
    return [
        ConfigProblem(
            key="parallel.tensor_parallel",
            value=tensor_parallel,
            message=f"must divide {prefix}.{key}={value}.",
            fix=fix,
        )
        for key, value in widths.items()
        if value % tensor_parallel
    ]


def check_class_name(config: Mapping[str, Any], class_name: str, label: str, source: str) -> None:
    """``ConfigError`` naming ``model.init_from`` unless ``config``'s ``_class_name`` (when
    present) is ``class_name``; ``label`` names the family in the message (``"a Wan"``)."""
    name = config.get("_class_name", class_name)
    if name != class_name:
        raise ConfigError(
            f"{source}: _class_name={name!r} is not {label} transformer",
            key="model.init_from",
            fix=f"point at a {class_name} directory (a pipeline's transformer/).",
        )


def resolve_transformer_dir(path: str | Path, *, class_name: str, pipeline: str) -> Path:
    """``path`` itself when it has a ``config.json``, else its ``transformer/`` subfolder (a
    diffusers pipeline directory); ``ConfigError`` naming ``model.init_from`` otherwise
    (``pipeline``: the pipeline's name in the fix, e.g. ``"Wan"``)."""
    root = Path(path)
    if (root / "config.json").is_file():
        return root
    if (root / "transformer" / "config.json").is_file():
        return root / "transformer"
    raise ConfigError(
        f"{root}: no config.json (nor transformer/config.json)",
        key="model.init_from",
        fix=f"point at a diffusers {class_name} directory or a {pipeline} pipeline directory.",
    )


def read_config_json[C](root: Path, parse: Callable[..., C]) -> C:
    """``parse(data, source=file)`` of ``root/config.json``; ``ConfigError`` naming
    ``model.init_from`` when it is not valid JSON."""
    file = root / "config.json"
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{file}: not valid JSON ({exc})", key="model.init_from", fix="re-download it."
        ) from None
    return parse(data, source=str(file))


def pick_flavor[C](flavors: Mapping[str, C], name: str, family: str) -> C:
    """``flavors[name]``; ``ConfigError`` naming ``model.flavor`` and the flavors otherwise."""
    if name not in flavors:
        raise ConfigError(
            f"unknown {family} flavor",
            key="model.flavor",
            value=name,
            fix=f"use one of {sorted(flavors)}",
        )
    return flavors[name]


__all__ = [
    "DiTConfigBase",
    "check_class_name",
    "pick_flavor",
    "read_config_json",
    "resolve_transformer_dir",
    "tensor_parallel_problems",
]
