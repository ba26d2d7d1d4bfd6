"""Hugging Face safetensors interop: read and write weights the way ``transformers`` does.

* ``save_safetensors`` writes ``model.safetensors``, or, above ``max_shard_bytes``,
  ``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``
  (``{"metadata": {"total_size", "total_parameters"}, "weight_map": {key: file}}``),
  i.e. the layout ``transformers``' ``save_pretrained``/``from_pretrained`` use.
* ``load_safetensors`` reads a single file, a sharded folder (through its index)
  or a folder of safetensors files, optionally only some keys (opening only the
  shards that hold them).

Safetensors never executes code on load; nothing here unpickles.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "load_safetensors",
    "save_safetensors",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # transformers' default "5GB"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _prepare(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; aliases of one storage become copies.

    safetensors refuses tensors that share memory (tied embeddings); saving a
    copy under every name keeps the round trip exact for every key.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"state_dict keys must be strings, got {key!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{key!r}] is a {type(value).__name__}, not a tensor")
        if type(value).__name__ == "DTensor":
            raise TypeError(
                f"state_dict[{key!r}] is a sharded DTensor; gather a full state dict first "
                "(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
                "cpu_offload=True))) and save it on rank 0"
            )
        t = value.detach().to("cpu").contiguous()
        storage = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() and storage in seen:
            t = t.clone()
        elif t.numel():
            seen.add(storage)
        out[key] = t
    return out


def _split(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in key order, like huggingface_hub: a tensor bigger than the limit gets its own shard."""
    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if nbytes > max_shard_bytes:
            shards.append({key: t})
            continue
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = t
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def save_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike[str],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    config: Mapping[str, Any] | Any | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write ``state_dict`` into ``out_dir`` as (sharded) safetensors; returns the files written.

    Args:
        state_dict: name -> tensor (full tensors; CPU or device).
        out_dir: created if missing; shard files of an earlier save are removed.
        max_shard_bytes: shard size limit (a single larger tensor gets its own shard).
        config: optional model config (a dict, or an object with ``to_dict()``)
            written as ``config.json`` next to the weights.
        metadata: extra string metadata stored in every file (``format: pt`` is always set).
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _prepare(state_dict)
    shards = _split(tensors, max_shard_bytes)
    file_meta = {"format": "pt", **dict(metadata or {})}

    for stale in out.iterdir():  # a smaller re-save must not leave old shards behind
        if stale.name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) or _SHARD_RE.match(
            stale.name
        ):
            stale.unlink()

    written: list[Path] = []
    weight_map: dict[str, str] = {}
    n = len(shards)
    for i, shard in enumerate(shards):
        name = SAFE_WEIGHTS_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out / name), metadata=file_meta)
        written.append(out / name)
        weight_map.update(dict.fromkeys(shard, name))
    if n > 1:
        index = {
            "metadata": {
                "total_parameters": sum(t.numel() for t in tensors.values()),
                "total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
            },
            "weight_map": weight_map,
        }
        index_path = out / SAFE_WEIGHTS_INDEX_NAME
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(index_path)
    if config is not None:
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        written.append(out / "config.json")
    return written


def _files_for(path: Path) -> dict[str, list[str] | None]:
    """file -> keys to read from it (None: all), for a file or a folder."""
    if path.is_file():
        return {str(path): None}
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a safetensors file nor a folder")
    index = path / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        by_file: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(str(path / name), []).append(key)
        return dict(by_file)
    if (path / SAFE_WEIGHTS_NAME).is_file():
        return {str(path / SAFE_WEIGHTS_NAME): None}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path} holds no {SAFE_WEIGHTS_NAME}, no {SAFE_WEIGHTS_INDEX_NAME} and no *.safetensors"
        )
    return {str(f): None for f in files}


def safetensors_dtypes(path_or_dir: str | os.PathLike[str]) -> set[str]:
    """The safetensors dtype names (``"F32"``, ``"BF16"``...) of every tensor in a file or
    folder, read from the headers only (no tensor data is loaded)."""
    dtypes: set[str] = set()
    for file in _files_for(Path(path_or_dir)):
        with safe_open(file, framework="pt", device="cpu") as f:
            names = list(f.keys())  # safe_open handles are not iterable
            dtypes.update(f.get_slice(key).get_dtype() for key in names)
    return dtypes


def load_safetensors(
    path_or_dir: str | os.PathLike[str],
    keys: Iterable[str] | None = None,
    *,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Read tensors from a safetensors file, a sharded folder, or a folder of files.

    ``keys`` limits what is read (only the shards holding them are opened); a
    key that is not there raises ``KeyError`` naming it and the path.
    """
    path = Path(path_or_dir)
    wanted = None if keys is None else list(dict.fromkeys(keys))
    out: dict[str, torch.Tensor] = {}
    for file, listed in _files_for(path).items():
        if wanted is not None and listed is not None and not set(listed) & set(wanted):
            continue  # the index says this shard holds none of the wanted keys
        if not Path(file).is_file():
            raise FileNotFoundError(
                f"{file} is listed in {path / SAFE_WEIGHTS_INDEX_NAME} but missing"
            )
        with safe_open(file, framework="pt", device=str(device)) as f:
            available = list(f.keys())
            take = available if wanted is None else [k for k in available if k in set(wanted)]
            for key in take:
                if key in out:
                    raise ValueError(f"key {key!r} appears in more than one file under {path}")
                out[key] = f.get_tensor(key)
    if wanted is not None:
        missing = [k for k in wanted if k not in out]
        if missing:
            raise KeyError(
                f"{path} has no tensor named {', '.join(map(repr, missing[:5]))}"
                + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            )
    return out
