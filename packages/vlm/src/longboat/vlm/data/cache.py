"""Encoded conversations cached on disk: encode once (``data prepare`` or the first run),
reuse after.

``encoded_samples(files, encoder, cache_dir=...)`` reads and encodes the conversations, or
with a cache directory loads what an earlier call wrote there. The entry's name is a hash
of everything the samples depend on: the conversation files' paths and bytes, the media
root, the tokenizer's files, the vision processor's and video sampler's settings, the
vision tokens, ``seq_len`` and the overflow / bad-sample policies. A changed file or option
gives a new entry; the same ones reuse the finished one. Media files are not hashed (that
would read every image): an image resized since it was encoded is caught when its row is
built (its grid no longer matches) with a message to encode again.

An entry is built in ``.<name>.tmp-<pid>`` and renamed into place after ``manifest.json``,
so a directory under its final name is always complete: an interrupted build (Ctrl-C, a
kill) leaves at most a temp directory, never read, and removed by the next build once its
process is gone. No pickles: token arrays are ``.npy`` (loaded with ``allow_pickle=False``),
the per-sample media references and grids JSON, embedded image bytes one binary file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from longboat.vlm.data.conversations import MediaRef, _files, read_conversations
from longboat.vlm.data.encoding import (
    EncodedSample,
    EncodingReport,
    Overflow,
    SampleEncoder,
    encode_conversations,
)
from longboat.vlm.data.errors import DataError

__all__ = ["FORMAT_VERSION", "MANIFEST", "CachedSamples", "cache_key", "encoded_samples"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
_CHUNK = 8 * 1024 * 1024


@dataclass
class CachedSamples:
    """Encoded samples, their counters and where they came from."""

    samples: list[EncodedSample]
    report: EncodingReport
    path: Path | None
    """The cache entry (None without a cache directory)."""
    reused: bool
    """True when the entry existed and was loaded instead of encoding."""


def _sha_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_sha(tokenizer_dir: str | Path) -> str:
    """sha256 over a tokenizer directory's own files (not model weights next to them)."""
    root = Path(tokenizer_dir)
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if (root / name).is_file():
            h.update(name.encode())
            h.update((root / name).read_bytes())
    return h.hexdigest()


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def cache_key(
    files: Sequence[Path],
    encoder: SampleEncoder,
    *,
    tokenizer_dir: str | Path,
    seq_len: int | None,
    root: str | Path | None,
    overflow: Overflow,
    skip_bad_samples: bool,
) -> dict[str, Any]:
    """Everything the encoded samples depend on (its hash names the cache entry)."""
    return {
        "format_version": FORMAT_VERSION,
        "files": [[str(f.resolve()), _sha_file(f)] for f in files],
        "root": str(Path(root).resolve()) if root is not None else None,
        "tokenizer": tokenizer_sha(tokenizer_dir),
        "vocab": len(encoder.tokenizer),
        "processor": {type(encoder.processor).__name__: _plain(encoder.processor.config)},
        "video": _plain(encoder.video),
        "tokens": _plain(encoder.tokens),
        "seq_len": seq_len,
        "overflow": overflow,
        "skip_bad_samples": skip_bad_samples,
    }


# --- on-disk form ------------------------------------------------------------------------


def _ref_json(ref: MediaRef, blobs: list[bytes], at: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"field": ref.field}
    if ref.path is not None:
        out["path"] = str(ref.path)
    if ref.frames is not None:
        out["frames"] = [str(f) for f in ref.frames]
    if ref.data is not None:
        out["data"] = [at[0], len(ref.data)]
        blobs.append(ref.data)
        at[0] += len(ref.data)
    return out


def _ref_of(d: dict[str, Any], media: memoryview) -> MediaRef:
    data = None
    if "data" in d:
        start, size = d["data"]
        data = bytes(media[start : start + size])
    return MediaRef(
        field=d["field"],
        path=Path(d["path"]) if "path" in d else None,
        frames=tuple(Path(f) for f in d["frames"]) if "frames" in d else None,
        data=data,
    )


def _write(out: Path, samples: list[EncodedSample]) -> None:
    lengths = np.asarray([len(s) for s in samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(out / "input_ids.npy", np.concatenate([s.input_ids for s in samples]))
    np.save(out / "loss_mask.npy", np.concatenate([s.loss_mask for s in samples]))
    np.save(out / "offsets.npy", offsets)
    blobs: list[bytes] = []
    at = [0]
    meta = [
        {
            "where": s.where,
            "images": [_ref_json(r, blobs, at) for r in s.images],
            "image_grid_thw": s.image_grid_thw.tolist(),
            "videos": [_ref_json(r, blobs, at) for r in s.videos],
            "video_grid_thw": s.video_grid_thw.tolist(),
            "video_frames": [list(f) for f in s.video_frames],
            "second_per_grid": list(s.second_per_grid),
        }
        for s in samples
    ]
    (out / "media.bin").write_bytes(b"".join(blobs))
    (out / "samples.json").write_text(json.dumps(meta))


def _read(entry: Path) -> list[EncodedSample]:
    ids = np.load(entry / "input_ids.npy", allow_pickle=False)
    mask = np.load(entry / "loss_mask.npy", allow_pickle=False)
    offsets = np.load(entry / "offsets.npy", allow_pickle=False)
    meta = json.loads((entry / "samples.json").read_text())
    media = memoryview((entry / "media.bin").read_bytes())
    out = []
    for i, m in enumerate(meta):
        a, b = int(offsets[i]), int(offsets[i + 1])
        out.append(
            EncodedSample(
                where=m["where"],
                input_ids=ids[a:b].astype(np.int64),
                loss_mask=mask[a:b].astype(np.uint8),
                images=tuple(_ref_of(r, media) for r in m["images"]),
                image_grid_thw=np.asarray(m["image_grid_thw"], np.int64).reshape(-1, 3),
                videos=tuple(_ref_of(r, media) for r in m["videos"]),
                video_grid_thw=np.asarray(m["video_grid_thw"], np.int64).reshape(-1, 3),
                video_frames=tuple(tuple(f) for f in m["video_frames"]),
                second_per_grid=tuple(m["second_per_grid"]),
            )
        )
    return out


def _clean_leftovers(cache: Path, name: str) -> None:
    for tmp in cache.glob(f".{name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        alive = False
        if pid.isdigit() and int(pid) != os.getpid():
            with contextlib.suppress(OSError):
                os.kill(int(pid), 0)
                alive = True
        if not alive:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _progress_bar(total: int, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    cols = (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress("[progress.description]{task.description}", *cols, transient=True) as bar:
        task = bar.add_task("encoding conversations", total=total)
        yield lambda i: bar.update(task, completed=i + 1)


def _encode(
    paths: Sequence[str | Path],
    encoder: SampleEncoder,
    *,
    seq_len: int | None,
    root: str | Path | None,
    overflow: Overflow,
    skip_bad_samples: bool,
    progress: bool,
) -> tuple[list[EncodedSample], EncodingReport]:
    convs = [c for p in paths for c in read_conversations(p, root=root)]
    with _progress_bar(len(convs), progress) as advance:
        return encode_conversations(
            convs,
            encoder,
            max_len=seq_len,
            overflow=overflow,
            skip_bad_samples=skip_bad_samples,
            progress=advance,
        )


def encoded_samples(
    paths: Sequence[str | Path],
    encoder: SampleEncoder,
    *,
    tokenizer_dir: str | Path,
    seq_len: int | None,
    root: str | Path | None = None,
    overflow: Overflow = "error",
    skip_bad_samples: bool = False,
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> CachedSamples:
    """The encoded samples of the conversation files / folders ``paths`` (see the module
    doc); ``cache_dir=None`` encodes without a cache. ``progress``: a bar while encoding."""
    opts = dict(seq_len=seq_len, root=root, overflow=overflow, skip_bad_samples=skip_bad_samples)
    if cache_dir is None:
        samples, report = _encode(paths, encoder, progress=progress, **opts)
        return CachedSamples(samples, report, None, False)
    files = [f for p in paths for f in _files(Path(p))]
    key = cache_key(files, encoder, tokenizer_dir=tokenizer_dir, **opts)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    cache = Path(cache_dir)
    name = f"{files[0].stem}-{digest}"
    entry = cache / name
    if (entry / MANIFEST).is_file():
        manifest = json.loads((entry / MANIFEST).read_text())
        report = EncodingReport(**manifest["report"])
        return CachedSamples(_read(entry), report, entry, True)
    start = time.perf_counter()
    samples, report = _encode(paths, encoder, progress=progress, **opts)
    if not samples:
        raise DataError(f"{paths}: no samples to cache: every record was skipped or dropped")
    cache.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(cache, name)
    tmp = cache / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write(tmp, samples)
        manifest = {
            "key": key,
            "num_samples": len(samples),
            "num_tokens": int(sum(len(s) for s in samples)),
            "report": dataclasses.asdict(report),
            "build_seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")  # last: complete
        try:
            tmp.rename(entry)
        except OSError:  # another process finished the same entry first: keep theirs
            if not (entry / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return CachedSamples(samples, report, entry, False)
