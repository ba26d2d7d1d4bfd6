"""The on-disk format of latent datasets: safetensors shards and a JSON manifest.

A dataset is a directory::

    manifest.json                 counts, shapes, checksums, encoders, options
    shards/shard-00000.safetensors
    shards/shard-00001.safetensors
    ...

Sample ``j`` of a shard is the tensors ``{j}.latents`` (VAE latents ``[C, T, H, W]``, C = 16
for Wan) and ``{j}.text_embeds`` (text-encoder states ``[L, D]``, unpadded: ``L`` real tokens,
D = 4096 for UMT5-XXL); the shard's safetensors header metadata ``samples`` is a JSON list of
each sample's metadata (``caption``, ``source``, ``fps``, ``frames``, ``height``, ``width``).

The manifest lists every finished shard with its sample count, bytes, SHA-256 and each
sample's latent shape and text length (so batches are planned without opening shards), and
says whether the dataset is ``complete``. Shards and the manifest are written to a temporary
file and renamed into place, and a shard counts only once the manifest lists it: a crash never
leaves a shard that looks valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from longboat.diffusion.data.errors import DataError

__all__ = [
    "FORMAT",
    "MANIFEST",
    "SHARD_DIR",
    "VERSION",
    "LatentRecord",
    "ShardInfo",
    "atomic_write_bytes",
    "file_sha256",
    "new_manifest",
    "read_manifest",
    "shard_infos",
    "write_manifest",
    "write_shard",
]

FORMAT = "longboat-diffusion-latents"
VERSION = 1
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Storage dtypes of latents and text embeddings."""


@dataclass
class LatentRecord:
    """One sample: latents ``[C, T, H, W]``, text embeddings ``[L, D]`` and its metadata."""

    latents: torch.Tensor
    text_embeds: torch.Tensor
    caption: str
    source: str
    """Where it came from (input file, or a generator's name)."""
    fps: float = 0.0
    """Frame rate of the encoded frames (0 for images)."""
    frames: int = 1
    """Encoded pixel frames (``4k + 1`` for Wan videos, 1 for images)."""
    height: int = 0
    """Encoded pixel height."""
    width: int = 0
    """Encoded pixel width."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More metadata kept with the sample (JSON values)."""
    pooled_embeds: torch.Tensor | None = None
    """``[P]``: a pooled caption embedding (FLUX: CLIP's), for families that take one."""

    def metadata(self) -> dict[str, Any]:
        """The JSON metadata stored for this sample."""
        return {
            "caption": self.caption,
            "source": self.source,
            "fps": float(self.fps),
            "frames": int(self.frames),
            "height": int(self.height),
            "width": int(self.width),
            **self.extra,
        }


@dataclass(frozen=True)
class ShardInfo:
    """A finished shard as the manifest lists it."""

    file: str
    """Path relative to the dataset directory."""
    num_samples: int
    bytes: int
    sha256: str
    latent_shapes: tuple[tuple[int, int, int], ...]
    """``(T, H, W)`` of each sample's latents."""
    text_lengths: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        """The manifest entry."""
        return {
            "file": self.file,
            "num_samples": self.num_samples,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "latent_shapes": [list(s) for s in self.latent_shapes],
            "text_lengths": list(self.text_lengths),
        }


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (never half-written)."""
    tmp = _tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_shard(root: Path, index: int, records: Sequence[LatentRecord], dtype: str) -> ShardInfo:
    """Write ``records`` as shard ``index`` of the dataset at ``root`` (atomically); returns
    its manifest entry. Latents and text embeddings are stored as ``dtype``."""
    from safetensors.torch import save_file

    if not records:
        raise ValueError("a shard needs at least one sample")
    store = DTYPES[dtype]
    tensors: dict[str, torch.Tensor] = {}
    for j, r in enumerate(records):
        if r.latents.dim() != 4 or r.text_embeds.dim() != 2:
            raise ValueError(
                f"sample {j} ({r.source}): latents {tuple(r.latents.shape)} must be [C, T, H, W] "
                f"and text_embeds {tuple(r.text_embeds.shape)} [L, D]"
            )
        tensors[f"{j}.latents"] = r.latents.detach().to("cpu", store).contiguous()
        tensors[f"{j}.text_embeds"] = r.text_embeds.detach().to("cpu", store).contiguous()
        if r.pooled_embeds is not None:
            tensors[f"{j}.pooled_embeds"] = r.pooled_embeds.detach().to("cpu", store).contiguous()
    meta = {"samples": json.dumps([r.metadata() for r in records]), "format": FORMAT}
    rel = f"{SHARD_DIR}/shard-{index:05d}.safetensors"
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    digest = file_sha256(tmp)
    size = tmp.stat().st_size
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return ShardInfo(
        file=rel,
        num_samples=len(records),
        bytes=size,
        sha256=digest,
        latent_shapes=tuple(tuple(int(d) for d in r.latents.shape[1:]) for r in records),
        text_lengths=tuple(int(r.text_embeds.shape[0]) for r in records),
    )


def new_manifest(
    *,
    latent_channels: int,
    text_dim: int,
    dtype: str,
    encoders: dict[str, Any],
    options: dict[str, Any],
) -> dict[str, Any]:
    """An empty, incomplete manifest."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "complete": False,
        "num_samples": 0,
        "num_shards": 0,
        "bytes": 0,
        "latent_channels": int(latent_channels),
        "text_dim": int(text_dim),
        "dtype": dtype,
        "encoders": encoders,
        "options": options,
        "shards": [],
    }


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Recount ``manifest``'s totals from its shards and write it atomically."""
    shards = manifest["shards"]
    manifest["num_shards"] = len(shards)
    manifest["num_samples"] = sum(int(s["num_samples"]) for s in shards)
    manifest["bytes"] = sum(int(s["bytes"]) for s in shards)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(root / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of the dataset at ``root``; ``DataError`` when it is missing or malformed."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        hint = (
            "the folder does not exist"
            if not Path(root).exists()
            else "no manifest.json there (not a latent dataset, or its preparation never "
            "finished a shard)"
        )
        raise DataError(
            f"{root}: {hint}. Write one with `longboat-diffusion data prepare` or the "
            "synthetic_squares generator"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not readable JSON ({exc}); re-run the preparation") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise DataError(
            f"{path}: format version {manifest.get('version')!r}, this longboat reads "
            f"{VERSION}; prepare the dataset again"
        )
    for key in ("shards", "latent_channels", "text_dim", "dtype", "complete"):
        if key not in manifest:
            raise DataError(f"{path}: no {key!r} entry; the manifest is damaged")
    if manifest["dtype"] not in DTYPES:
        raise DataError(f"{path}: unknown dtype {manifest['dtype']!r}")
    return manifest


def shard_infos(manifest: dict[str, Any], where: str) -> list[ShardInfo]:
    """The manifest's shards; ``DataError`` naming the shard when an entry is inconsistent."""
    out = []
    for k, s in enumerate(manifest["shards"]):
        try:
            info = ShardInfo(
                file=str(s["file"]),
                num_samples=int(s["num_samples"]),
                bytes=int(s["bytes"]),
                sha256=str(s["sha256"]),
                latent_shapes=tuple(tuple(int(d) for d in shp) for shp in s["latent_shapes"]),
                text_lengths=tuple(int(n) for n in s["text_lengths"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{where}: shard entry {k} is damaged ({exc!r})") from None
        if not (
            len(info.latent_shapes) == len(info.text_lengths) == info.num_samples
            and all(len(shp) == 3 for shp in info.latent_shapes)
        ):
            raise DataError(
                f"{where}: shard entry {k} ({info.file}) lists {info.num_samples} samples but "
                f"{len(info.latent_shapes)} shapes / {len(info.text_lengths)} text lengths"
            )
        out.append(info)
    return out
