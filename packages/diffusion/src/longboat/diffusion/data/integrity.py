"""Shard integrity checked by default: SHA-256 and finite values, once per file version.

The first time a dataset is opened, every shard's SHA-256 is compared with the manifest's and
every tensor is checked for NaN / Inf. The result is cached in ``<dataset>/.checked.json``
per shard file, keyed by its size and modification time, so later opens of an unchanged
dataset read no shard bytes; a shard rewritten or edited in place gets a new mtime and is
checked again. ``verify=True`` (``data.verify=true``) ignores the cache and checks every byte
(bit rot that leaves the mtime alone). A dataset folder that is not writable is checked on
every open.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longboat.diffusion.data.shards import atomic_write_bytes, file_sha256

__all__ = ["CHECK_CACHE", "ShardCheck", "check_shards"]

CHECK_CACHE = ".checked.json"
"""File in a dataset folder caching its shards' check results."""


@dataclass(frozen=True)
class ShardCheck:
    """What reading a shard found."""

    sha256: str
    """Hex SHA-256 of the file's bytes."""
    nonfinite: tuple[tuple[int, str], ...]
    """``(sample, tensor)`` of every tensor holding NaN or Inf (``latents`` / ``text_embeds``)."""


def _read(path: Path) -> ShardCheck:
    """Hash the file, then look at its tensors one at a time (memory-mapped)."""
    from safetensors import safe_open

    digest = file_sha256(path)
    bad: list[tuple[int, str]] = []
    try:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                tensor = handle.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    sample, _, kind = name.partition(".")
                    bad.append((int(sample) if sample.isdigit() else -1, kind or name))
    except Exception:  # not safetensors: the checksum (or the reader later) names the shard
        return ShardCheck(digest, ())
    return ShardCheck(digest, tuple(sorted(bad)))


def _load_cache(root: Path) -> dict[str, Any]:
    try:
        cache = json.loads((root / CHECK_CACHE).read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def check_shards(root: Path, files: list[str], *, force: bool = False) -> dict[str, ShardCheck]:
    """The check of each shard ``files`` (paths relative to ``root``): from the cache when
    the file's size and mtime match a cached entry (unless ``force``), else read now and
    cached (best effort: a read-only folder is simply not cached)."""
    cache = {} if force else _load_cache(root)
    out: dict[str, ShardCheck] = {}
    changed = False
    for rel in files:
        stat = (root / rel).stat()
        key = [stat.st_size, stat.st_mtime_ns]
        entry = cache.get(rel)
        if isinstance(entry, dict) and entry.get("stat") == key:
            try:
                out[rel] = ShardCheck(
                    str(entry["sha256"]), tuple((int(j), str(t)) for j, t in entry["nonfinite"])
                )
                continue
            except (KeyError, TypeError, ValueError):
                pass
        check = _read(root / rel)
        out[rel] = check
        cache[rel] = {"stat": key, "sha256": check.sha256, "nonfinite": check.nonfinite}
        changed = True
    if changed:
        with contextlib.suppress(OSError):
            atomic_write_bytes(root / CHECK_CACHE, json.dumps(cache).encode())
    return out
