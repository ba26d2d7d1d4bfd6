"""Keys that were renamed: an old name gives an error naming its replacement.

Core lists its own renamed keys in ``CORE_RENAMED_KEYS``; a stack lists its own in
``Stack.renamed_keys``. At compose time (``take_renamed_keys``, before the unknown-key
check with its did-you-mean) every old key the YAML or the command line sets, and that the
schema no longer has, becomes one problem: ``<old>: was renamed. Fix: use <new>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from longboat.core.config.errors import ProblemCollector

CORE_RENAMED_KEYS: Mapping[str, str] = {
    "train.activation_checkpointing": "train.recompute",
    "logging.tensorboard": "logging.trackers (a list: [tensorboard] for true, [] for false)",
}
"""Old core key -> what replaces it."""


def _known(typed: DictConfig, parts: list[str]) -> bool:
    """Whether the typed schema has the key ``parts`` (then it is no longer an old name)."""
    node: Any = typed
    for part in parts:
        if not isinstance(node, DictConfig) or part not in [str(k) for k in node.keys()]:  # noqa: SIM118
            return False
        node = node._get_node(part)
    return True


def take_renamed_keys(
    composed: dict[str, Any],
    typed: DictConfig,
    renamed: Mapping[str, str],
    problems: ProblemCollector,
    bad_keys: set[str],
) -> None:
    """Remove every key of ``renamed`` that ``composed`` sets and ``typed`` does not know,
    adding one problem each naming the replacement."""
    for old, new in renamed.items():
        *parents, leaf = old.split(".")
        holder: Any = composed
        for part in parents:
            holder = holder.get(part) if isinstance(holder, dict) else None
        if not isinstance(holder, dict) or leaf not in holder or _known(typed, old.split(".")):
            continue
        value = holder.pop(leaf)
        problems.add(old, f"was renamed to {new}", value=value, fix=f"use {new}")
        bad_keys.add(old)


__all__ = ["CORE_RENAMED_KEYS", "take_renamed_keys"]
