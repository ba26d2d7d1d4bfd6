"""The checkpoint manifest: what a finished checkpoint is, and proof its files are intact.

``manifest.json`` is the last file written into a checkpoint (before the
directory is renamed into place), so a directory without a readable manifest is
by construction an unfinished or damaged checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from longboat.core.checkpoint.errors import CheckpointCorruptError, InvalidCheckpointError

__all__ = [
    "MANIFEST_NAME",
    "Manifest",
    "build_manifest",
    "file_sha256",
    "fsync_dir",
    "read_manifest",
    "verify_files",
    "write_manifest",
]

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class Manifest:
    """Contents of ``manifest.json``."""

    step: int
    time_utc: str
    world_size: int
    longboat_version: str
    files: dict[str, dict[str, Any]]
    """Relative path -> {"sha256": hex, "bytes": size}."""
    config: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "step": self.step,
            "time_utc": self.time_utc,
            "world_size": self.world_size,
            "longboat_version": self.longboat_version,
            "files": self.files,
            "config": self.config,
        }


def _longboat_version() -> str:
    try:
        return importlib_metadata.version("longboat-core")
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (renames/creates inside it) to disk where the OS allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _listed_files(ckpt_dir: Path) -> list[Path]:
    return sorted(
        p
        for p in ckpt_dir.rglob("*")
        if p.is_file() and p.relative_to(ckpt_dir).as_posix() != MANIFEST_NAME
    )


def build_manifest(
    ckpt_dir: Path, *, step: int, world_size: int, config: dict[str, Any] | None
) -> Manifest:
    """Hash every file under ``ckpt_dir`` and describe the checkpoint."""
    files = {}
    for p in _listed_files(ckpt_dir):
        files[p.relative_to(ckpt_dir).as_posix()] = {
            "sha256": file_sha256(p),
            "bytes": p.stat().st_size,
        }
    return Manifest(
        step=step,
        time_utc=datetime.now(UTC).isoformat(timespec="seconds"),
        world_size=world_size,
        longboat_version=_longboat_version(),
        files=files,
        config=config or {},
    )


def write_manifest(ckpt_dir: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` durably (temp file, fsync, rename)."""
    tmp = ckpt_dir / (MANIFEST_NAME + ".partial")
    with open(tmp, "w") as f:
        json.dump(manifest.to_json(), f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST_NAME)
    fsync_dir(ckpt_dir)


def read_manifest(ckpt_dir: Path) -> Manifest:
    """Parse and sanity-check ``manifest.json``; ``InvalidCheckpointError`` says what is wrong."""
    path = ckpt_dir / MANIFEST_NAME
    if not path.is_file():
        raise InvalidCheckpointError(
            f"{ckpt_dir} has no {MANIFEST_NAME}: the save did not finish (or the folder is not a "
            "longboat checkpoint)"
        )
    try:
        raw = json.loads(path.read_text())
        manifest = Manifest(
            step=int(raw["step"]),
            time_utc=str(raw["time_utc"]),
            world_size=int(raw["world_size"]),
            longboat_version=str(raw["longboat_version"]),
            files=dict(raw["files"]),
            config=dict(raw.get("config") or {}),
            format_version=int(raw["format_version"]),
        )
        for name, info in manifest.files.items():
            if not isinstance(info, dict) or not isinstance(info.get("sha256"), str):
                raise ValueError(f"file entry {name!r} has no sha256")
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise InvalidCheckpointError(f"{path} is not a valid manifest: {exc}") from exc
    if manifest.format_version > FORMAT_VERSION:
        raise InvalidCheckpointError(
            f"{path} has format_version {manifest.format_version}; this longboat reads up to "
            f"{FORMAT_VERSION}: upgrade longboat-core to load it"
        )
    return manifest


def verify_files(ckpt_dir: Path, manifest: Manifest, names: list[str] | None = None) -> None:
    """Check size and sha256 of ``names`` (default: every listed file) against the manifest."""
    for name in manifest.files if names is None else names:
        info = manifest.files[name]
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointCorruptError(
                f"checkpoint {ckpt_dir} is missing {name}, which its manifest lists"
            )
        size = path.stat().st_size
        if "bytes" in info and size != info["bytes"]:
            raise CheckpointCorruptError(
                f"checkpoint {ckpt_dir}: {name} has {size} bytes, the manifest says "
                f"{info['bytes']} (the file is truncated or corrupted)"
            )
        digest = file_sha256(path)
        if digest != info["sha256"]:
            raise CheckpointCorruptError(
                f"checkpoint {ckpt_dir}: checksum mismatch in {name} (sha256 {digest[:16]}..., "
                f"manifest {info['sha256'][:16]}...: the file is corrupted)"
            )
