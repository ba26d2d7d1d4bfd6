"""Raw data files trained on directly: tokenised on first use into a cache, reused after.

``data.paths`` may name a raw JSONL / JSON-lines / Parquet file, a folder of them, or a
Hugging Face ``datasets`` folder (``save_to_disk``), besides datasets written by
``longboat-llm data prepare``. A raw input is prepared (``prepare_dataset``, with a progress
bar) into ``<cache>/<key>``, where the key is a hash of the input's bytes, the tokenizer's
files and the options: a changed file, another tokenizer or other options give a new entry,
the same ones reuse the finished dataset. The bytes are hashed once per (path, size,
modification time); ``index.json`` in the cache remembers the result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from longboat.llm.data import sources
from longboat.llm.data.indexed import MANIFEST, IncompleteDatasetError, read_manifest
from longboat.llm.data.prepare import PrepareOptions, prepare_dataset, tokenizer_fingerprint

_CHUNK = 8 * 1024 * 1024


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/longboat/datasets`` (``~/.cache/longboat/datasets``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "longboat" / "datasets"


def is_raw_input(path: Path) -> bool:
    """True for a raw file or folder; False for a dataset ``data prepare`` wrote (finished or
    not: an unfinished one is reported as such, not re-read as raw)."""
    if path.is_file() or sources.hub_dataset_id(path) is not None:
        return True
    return path.is_dir() and not (path / MANIFEST).is_file() and not (path / "tokens.bin").exists()


def detect_format(spec: sources.InputSpec, columns: dict[str, str] | None = None) -> str:
    """``sft`` when the first record is in a chat form (``messages``, ShareGPT
    ``conversations``, Alpaca, prompt / completion; keys through ``columns``), else
    ``pretrain``."""
    from longboat.llm.data.sft_records import chat_form, rename_keys

    try:
        first = sources.first_record(spec, None)
    except (KeyError, ValueError):
        return "pretrain"
    if not isinstance(first, dict):
        return "pretrain"
    return "sft" if chat_form(rename_keys(first, columns or {})) else "pretrain"


def _content_sha(spec: sources.InputSpec, cache: Path) -> str:
    """sha256 of the input files' bytes, remembered per (path, size, mtime) in the cache."""
    index_file = cache / "index.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = {}
    stamp = json.dumps(spec.fingerprint(), sort_keys=True)
    if stamp in index:
        return str(index[stamp])
    h = hashlib.sha256()
    for f in spec.files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    digest = h.hexdigest()
    index[stamp] = digest
    cache.mkdir(parents=True, exist_ok=True)
    tmp = index_file.with_name(f"index.json.{os.getpid()}")
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(index_file)
    return digest


def prepared_path(
    path: str | Path,
    tokenizer: str | Path,
    *,
    cache_dir: str | Path | None = None,
    format: str = "auto",
    columns: dict[str, str] | None = None,
    log: Any = print,
    progress: bool = True,
) -> Path:
    """The prepared dataset of raw input ``path`` (built into the cache when missing);
    ``columns`` maps longboat's record keys to yours (``sft_records``)."""
    spec = sources.resolve_input(path)
    columns = dict(columns or {})
    fmt = detect_format(spec, columns) if format == "auto" else format
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    opts = PrepareOptions(
        input=Path(path), tokenizer=Path(tokenizer), output=cache, format=fmt, columns=columns
    )
    key = hashlib.sha256(
        json.dumps(
            {
                "content": _content_sha(spec, cache),
                "tokenizer": tokenizer_fingerprint(Path(tokenizer))["sha256"],
                "options": opts.fingerprint_options(),
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:20]
    out = cache / f"{Path(path).stem}-{fmt}-{key}"
    try:
        read_manifest(out)
        return out  # built before from the same bytes, tokenizer and options
    except (FileNotFoundError, IncompleteDatasetError):
        pass
    log(f"Preparing {path} ({fmt}) into {out} (once; reused while the file is unchanged)")
    opts = dataclasses.replace(opts, output=out, force=out.exists())  # replace a broken build
    prepare_dataset(opts, log=log, progress=progress)
    return out


__all__ = ["default_cache_dir", "detect_format", "is_raw_input", "prepared_path"]
