"""``data prepare``: videos / images + captions -> a latent dataset, resumably.

Sources (:mod:`~longboat.diffusion.data.sources`) are encoded in their fixed order
(frames: :mod:`~longboat.diffusion.data.media`; encoders:
:mod:`~longboat.diffusion.data.encoders`) and written ``samples_per_shard`` at a time. After
each shard the manifest is rewritten (atomically) with the shard and how many sources are done
(encoded into a listed shard, or skipped and counted), so:

- a killed run resumes where its last finished shard ended (samples of an unfinished shard are
  encoded again; finished shards are never rewritten);
- a re-run of a finished preparation does nothing;
- a re-run with other inputs, options or encoders stops with an error (``overwrite=true``
  starts over).

A corrupt video / image or a missing caption stops the run with an error naming the file, or
with ``skip_bad_samples=true`` is skipped and listed in the manifest (``skipped``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from longboat.diffusion.data.empty_caption import read_empty_caption, write_empty_caption
from longboat.diffusion.data.errors import BadSampleError, DataError
from longboat.diffusion.data.media import load_clip
from longboat.diffusion.data.schema import PrepareConfig
from longboat.diffusion.data.shards import (
    MANIFEST,
    SHARD_DIR,
    LatentRecord,
    new_manifest,
    read_manifest,
    shard_infos,
    write_manifest,
    write_shard,
)
from longboat.diffusion.data.sources import Source, list_sources, sources_fingerprint

__all__ = ["Encoders", "PrepareReport", "prepare_latents"]


class Encoders(Protocol):
    """What ``prepare`` needs of its encoders (:class:`~longboat.diffusion.data.encoders.WanEncoders`)."""

    latent_channels: int
    text_dim: int
    temporal: int

    def check(self, cfg: PrepareConfig) -> None: ...
    def fingerprint(self) -> dict[str, Any]: ...
    def encode_frames(self, frames: np.ndarray) -> torch.Tensor: ...
    def encode_text(self, caption: str) -> torch.Tensor: ...


@dataclass
class PrepareReport:
    """What a ``prepare`` run did."""

    out: Path
    sources: int
    """Inputs listed."""
    encoded: int
    """Samples encoded by this run."""
    resumed_from: int
    """Sources an earlier run had finished (0: a fresh start)."""
    num_samples: int
    num_shards: int
    bytes: int
    skipped: list[dict[str, str]] = field(default_factory=list)
    """Every skipped input (``file``, ``problem``), earlier runs' included."""
    up_to_date: bool = False
    """Nothing was left to do."""

    def lines(self) -> list[str]:
        """A human summary."""
        if self.up_to_date:
            head = f"{self.out}: up to date ({self.num_samples:,} samples)"
        else:
            again = f", resumed after {self.resumed_from:,} finished" if self.resumed_from else ""
            head = f"{self.out}: encoded {self.encoded:,} of {self.sources:,} inputs{again}"
        out = [
            head,
            f"{self.num_samples:,} samples in {self.num_shards:,} shards, "
            f"{self.bytes / 2**20:,.1f} MiB; {len(self.skipped):,} skipped",
        ]
        out += [f"  skipped {s['file']}: {s['problem']}" for s in self.skipped[:10]]
        if len(self.skipped) > 10:
            out.append(f"  ... and {len(self.skipped) - 10} more (manifest.json lists them)")
        return out


def _options(cfg: PrepareConfig) -> dict[str, Any]:
    # What changes the samples; a resumed run must have the same.
    return {
        "targets": [list(t) for t in cfg.targets],
        "num_frames": cfg.num_frames,
        "fps": cfg.fps,
        "max_text_len": cfg.max_text_len,
        "samples_per_shard": cfg.samples_per_shard,
        "dtype": cfg.dtype,
        "vae_dtype": cfg.vae_dtype,
        "text_encoder_dtype": cfg.text_encoder_dtype,
    }


def _clean_leftovers(out: Path, num_shards: int) -> None:
    """Remove temporary files of killed runs and shards no manifest lists."""
    for folder in (out, out / SHARD_DIR):
        if not folder.is_dir():
            continue
        for tmp in folder.glob(".*.tmp-*"):
            pid = tmp.name.rsplit("-", 1)[-1]
            alive = False
            if pid.isdigit() and int(pid) != os.getpid():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), 0)
                    alive = True
            if not alive:
                tmp.unlink(missing_ok=True)
    for shard in (out / SHARD_DIR).glob("shard-*.safetensors"):
        stem = shard.stem.rsplit("-", 1)[-1]
        if stem.isdigit() and int(stem) >= num_shards:
            shard.unlink()


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


def _start_state(cfg: PrepareConfig, out: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest to continue (None: start afresh); errors on a foreign preparation."""
    if not (out / MANIFEST).is_file():
        return None
    manifest = read_manifest(out)
    shard_infos(manifest, str(out / MANIFEST))
    had = manifest.get("prepare", {})
    diff = _differences(had, identity)
    if not diff:
        return manifest
    if cfg.overwrite:
        return None
    raise DataError(
        f"out={str(out)!r} holds a preparation with other {', '.join(diff)}; write to another "
        "folder, or set overwrite=true to start over there"
    )


@contextlib.contextmanager
def _progress(total: int, done: int, enabled: bool) -> Iterator[Callable[[], None] | None]:
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    cols = (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress("[progress.description]{task.description}", *cols, transient=True) as bar:
        task = bar.add_task("encoding", total=total, completed=done)
        yield lambda: bar.advance(task)


def _record(src: Source, cfg: PrepareConfig, encoders: Encoders) -> LatentRecord:
    if src.caption is None:
        raise BadSampleError(str(src.path), f"no caption (expected in {src.caption_from})")
    clip = load_clip(
        src.path,
        targets=cfg.targets,
        num_frames=cfg.num_frames,
        fps=cfg.fps,
        temporal=encoders.temporal,
    )
    pooled = getattr(encoders, "encode_pooled", None)
    return LatentRecord(
        latents=encoders.encode_frames(clip.frames),
        text_embeds=encoders.encode_text(src.caption),
        pooled_embeds=pooled(src.caption) if pooled is not None else None,
        caption=src.caption,
        source=src.name,
        fps=clip.fps,
        frames=int(clip.frames.shape[0]),
        height=int(clip.frames.shape[1]),
        width=int(clip.frames.shape[2]),
    )


def _with_dirs(fingerprint: dict[str, Any], encoders: Encoders) -> dict[str, Any]:
    # Where each model was loaded from, for people reading the manifest; not part of the
    # identity a resumed run compares (the same model may move).
    dirs = getattr(encoders, "dirs", None)
    if dirs is None:
        return fingerprint
    return {k: {"dir": str(getattr(dirs, k, "")), **v} for k, v in fingerprint.items()}


def load_encoders(cfg: PrepareConfig) -> Encoders:
    """The encoders ``cfg`` names, on ``cfg.device``: a FLUX pipeline's VAE, T5 and CLIP
    (``model_dir`` a FLUX pipeline), else the Wan VAE and UMT5 encoder."""
    from longboat.core.device import get_accelerator
    from longboat.diffusion.data.encoders import WanEncoders, encoder_dirs
    from longboat.diffusion.data.flux_encoders import FluxEncoders, is_flux_pipeline

    device = get_accelerator(None if cfg.device == "auto" else cfg.device).device()
    if is_flux_pipeline(cfg.model_dir):
        return FluxEncoders(
            cfg.model_dir,
            device=device,
            vae_dtype=cfg.vae_dtype,
            text_dtype=cfg.text_encoder_dtype,
            max_text_len=cfg.max_text_len,
        )
    dirs = encoder_dirs(cfg)
    return WanEncoders(
        dirs,
        device=device,
        vae_dtype=cfg.vae_dtype,
        text_dtype=cfg.text_encoder_dtype,
        max_text_len=cfg.max_text_len,
    )


def prepare_latents(
    cfg: PrepareConfig,
    *,
    progress: bool = False,
    encoders: Encoders | None = None,
) -> PrepareReport:
    """Encode ``cfg.input`` into the latent dataset ``cfg.out`` (see the module doc).

    ``encoders``: already loaded encoders (default: load the ones ``cfg`` names).
    """
    cfg.validate()
    sources = list_sources(cfg.input, cfg.root)
    out = Path(cfg.out).expanduser()
    if encoders is None:
        from longboat.diffusion.data.encoders import encoder_dirs

        encoder_dirs(cfg)  # a missing directory fails before the models load
        encoders = load_encoders(cfg)
    encoders.check(cfg)
    from longboat.diffusion.data.encoders import encoders_key

    fingerprint = encoders.fingerprint()
    identity = {
        "sources": sources_fingerprint(sources),
        "options": _options(cfg),
        "encoders": encoders_key(fingerprint),
    }
    manifest = _start_state(cfg, out, identity)
    fresh = manifest is None
    if manifest is None:
        (out / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(out / SHARD_DIR, ignore_errors=True)
        manifest = new_manifest(
            latent_channels=encoders.latent_channels,
            text_dim=encoders.text_dim,
            dtype=cfg.dtype,
            encoders=_with_dirs(fingerprint, encoders),
            options=_options(cfg),
        )
        manifest["prepare"] = identity
        if getattr(encoders, "pooled_dim", 0):
            manifest["pooled_dim"] = int(encoders.pooled_dim)
        manifest["sources"] = {"total": len(sources), "done": 0, "skipped": []}
    done = int(manifest["sources"]["done"])
    skipped: list[dict[str, str]] = list(manifest["sources"]["skipped"])
    _clean_leftovers(out, len(manifest["shards"]))

    def report(encoded: int, up_to_date: bool = False) -> PrepareReport:
        return PrepareReport(
            out=out,
            sources=len(sources),
            encoded=encoded,
            resumed_from=done,
            num_samples=int(manifest.get("num_samples", 0)),
            num_shards=len(manifest["shards"]),
            bytes=int(manifest.get("bytes", 0)),
            skipped=list(manifest["sources"]["skipped"]),
            up_to_date=up_to_date,
        )

    if fresh or read_empty_caption(out) is None:  # also added to datasets prepared without it
        pooled = getattr(encoders, "encode_pooled", None)
        write_empty_caption(
            out, encoders.encode_text(""), pooled("") if pooled is not None else None
        )
    if manifest["complete"]:
        return report(0, up_to_date=True)

    buffer: list[LatentRecord] = []
    pending_skips: list[dict[str, str]] = []
    encoded = 0

    def commit(through: int) -> None:
        if buffer:
            info = write_shard(out, len(manifest["shards"]), buffer, cfg.dtype)
            manifest["shards"].append(info.to_json())
        skipped.extend(pending_skips)
        manifest["sources"]["done"] = through
        manifest["sources"]["skipped"] = list(skipped)
        write_manifest(out, manifest)
        buffer.clear()
        pending_skips.clear()

    with _progress(len(sources), done, progress) as advance:
        for i in range(done, len(sources)):
            src = sources[i]
            try:
                buffer.append(_record(src, cfg, encoders))
                encoded += 1
            except BadSampleError as exc:
                if not cfg.skip_bad_samples:
                    raise
                pending_skips.append({"file": exc.file, "problem": exc.problem})
            if len(buffer) == cfg.samples_per_shard:
                commit(i + 1)
            if advance is not None:
                advance()
    manifest["complete"] = True
    commit(len(sources))
    if manifest["num_samples"] == 0:
        raise DataError(
            f"input={cfg.input!r}: every one of the {len(sources)} inputs was skipped as bad "
            "(manifest.json lists them); nothing to train on"
        )
    return report(encoded)
