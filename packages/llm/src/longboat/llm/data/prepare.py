"""``data prepare``: tokenise an input into an indexed token dataset, atomically.

The build goes into ``.<name>.tmp-<pid>`` next to the output and is renamed into place after
``manifest.json`` is written, so the output directory either is a finished dataset or does
not exist (an old-format or foreign directory without a manifest is rebuilt). A rerun whose
input files, tokenizer and options fingerprint match the manifest is skipped.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from longboat.llm.data import encoding as tk
from longboat.llm.data import sources
from longboat.llm.data.indexed import (
    FORMAT_VERSION,
    MANIFEST,
    IncompleteDatasetError,
    IndexedDatasetWriter,
    read_manifest,
    token_dtype,
)
from longboat.llm.data.sft_records import to_messages

__all__ = ["PrepareOptions", "PrepareResult", "prepare_dataset", "tokenizer_fingerprint"]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """Options of one ``data prepare`` run (all part of the rerun fingerprint but workers)."""

    input: Path
    """JSONL/Parquet file or folder, or a Hugging Face ``datasets`` directory."""
    tokenizer: Path
    """Local Hugging Face tokenizer directory."""
    output: Path
    """Dataset directory to write."""
    format: Literal["pretrain", "sft"] = "pretrain"
    """``pretrain`` (plain text) or ``sft`` (chat ``messages`` with an assistant-only mask)."""
    text_key: str = "text"
    """Record key of the text (pretrain)."""
    messages_key: str = "messages"
    """Record key of the chat turns (sft)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Your record keys under longboat's names (``{"prompt": "question"}``; see
    ``longboat.llm.data.sft_records``): SFT records in any accepted chat form, and
    ``text`` for pretraining."""
    max_seq_len: int | None = None
    """SFT: longest record kept (tokens); longer ones follow ``sft_overflow``."""
    sft_overflow: Literal["truncate", "drop"] = "truncate"
    """SFT: what to do with a record longer than ``max_seq_len``."""
    append_eos: bool = True
    """Pretrain: end every document with the tokenizer's EOS token."""
    workers: int = 1
    """Tokeniser processes."""
    chunk_size: int = 256
    """Records per work item."""
    force: bool = False
    """Rebuild even when a matching finished dataset exists."""

    def fingerprint_options(self) -> dict[str, Any]:
        """The options that change the output (compared on rerun)."""
        out: dict[str, Any] = {"format": self.format}
        if self.format == "pretrain":
            out.update(text_key=self.record_key, append_eos=self.append_eos)
        else:
            out.update(
                messages_key=self.messages_key,
                max_seq_len=self.max_seq_len,
                sft_overflow=self.sft_overflow,
            )
            if self.columns:
                out["columns"] = dict(sorted(self.columns.items()))
        return out

    @property
    def record_key(self) -> str | None:
        """The key read from each record: the text's (pretrain), or None (sft: the whole
        record, whatever chat form it is in)."""
        if self.format == "sft":
            return None
        return self.columns.get("text", self.text_key)

    def sft_columns(self) -> dict[str, str]:
        """The key mapping SFT records are read through (``--messages-key`` included)."""
        if self.messages_key == "messages":
            return dict(self.columns)
        return {"messages": self.messages_key, **self.columns}

    def convert(self) -> Any:
        """What turns a read record into what is tokenised (sft: its turns), or None."""
        if self.format != "sft":
            return None
        columns = self.sft_columns()
        return lambda record, at: to_messages(record, at, columns)


@dataclass(frozen=True)
class PrepareResult:
    """Where the dataset is, whether it was built now, and its manifest."""

    path: Path
    skipped: bool
    manifest: dict[str, Any]


def tokenizer_fingerprint(path: Path) -> dict[str, Any]:
    """SHA-256 over the tokenizer's own files (not any model weights in the same folder)."""
    h = hashlib.sha256()
    names = [n for n in _TOKENIZER_FILES if (path / n).is_file()]
    for name in names:
        h.update(name.encode())
        h.update((path / name).read_bytes())
    return {"path": str(path.resolve()), "files": names, "sha256": h.hexdigest()}


def _validate(opts: PrepareOptions) -> tuple[Any, sources.InputSpec]:
    tdir = opts.tokenizer
    if not tdir.is_dir():
        raise FileNotFoundError(
            f"--tokenizer {tdir} is not a directory; pass a local Hugging Face tokenizer dir "
            "(with tokenizer.json or tokenizer_config.json)"
        )
    if not any((tdir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"--tokenizer {tdir} has no tokenizer.json or tokenizer_config.json; save one with "
            "tokenizer.save_pretrained(dir)"
        )
    if opts.workers < 1:
        raise ValueError(f"--workers={opts.workers} must be >= 1")
    if opts.max_seq_len is not None and opts.max_seq_len < 2:
        raise ValueError(f"--max-seq-len={opts.max_seq_len} must be >= 2")
    spec = sources.resolve_input(opts.input)
    key = opts.record_key
    first = sources.first_record(spec, key, opts.convert())
    try:
        tok = tk.load_tokenizer(tdir)
    except Exception as exc:  # transformers raises many kinds for a broken folder
        raise ValueError(f"--tokenizer {tdir} could not be loaded: {exc}") from exc
    if opts.format == "sft":
        if not getattr(tok, "is_fast", False):
            raise ValueError(
                f"--tokenizer {tdir} loads as a slow tokenizer; --format sft needs a fast one "
                "(tokenizer.json) for the offset mapping that locates assistant tokens"
            )
        if not getattr(tok, "chat_template", None):
            raise ValueError(
                f"--tokenizer {tdir} has no chat_template; --format sft renders conversations "
                "with it (set tokenizer.chat_template and save it)"
            )
        tk.render_sft(tok, first, 0)  # a template/record mismatch fails here, not in a worker
    elif first is not None and not isinstance(first, str):  # nulls are counted, not refused
        raise ValueError(
            f"{opts.input}: key {key!r} holds {type(first).__name__}, not text; name "
            "the text key (data.columns={text: <key>}, --text-key), or train it as sft "
            "(data.format=sft, --format sft)"
        )
    return tok, spec


def _clean_leftovers(output: Path, log: Callable[[str], None]) -> None:
    leftovers = [*output.parent.glob(f".{output.name}.tmp-*")]
    leftovers += output.parent.glob(f".{output.name}.old-*")
    for tmp in leftovers:
        pid = tmp.name.rsplit("-", 1)[-1]
        alive = False
        if pid.isdigit() and int(pid) != os.getpid():
            with contextlib.suppress(OSError):
                os.kill(int(pid), 0)
                alive = True
        if not alive:
            log(f"removing {tmp} left by an interrupted prepare")
            shutil.rmtree(tmp, ignore_errors=True)


def _jobs(
    spec: sources.InputSpec, key: str | None, opts: PrepareOptions
) -> Iterator[tuple[Any, ...]]:
    first = 0
    shared = {
        "max_seq_len": opts.max_seq_len,
        "overflow": opts.sft_overflow,
        "append_eos": opts.append_eos,
    }
    for chunk in sources.iter_record_chunks(spec, key, opts.chunk_size, opts.convert()):
        yield (opts.format, first, chunk, shared)
        first += len(chunk)


@contextlib.contextmanager
def _progress(total: int | None, enabled: bool) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    cols = (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress("[progress.description]{task.description}", *cols) as bar:
        task = bar.add_task("tokenising records", total=total)
        yield lambda n: bar.advance(task, n)


def prepare_dataset(
    opts: PrepareOptions, *, log: Callable[[str], None] = print, progress: bool = True
) -> PrepareResult:
    """Build (or skip) the dataset described by ``opts``; see the module doc."""
    tok, spec = _validate(opts)
    fingerprint = {
        "input": spec.fingerprint(),
        "tokenizer": tokenizer_fingerprint(opts.tokenizer),
        "options": opts.fingerprint_options(),
    }
    output = opts.output
    _clean_leftovers(output, log)
    if output.exists():
        try:
            old = read_manifest(output)
        except IncompleteDatasetError as exc:
            log(f"rebuilding: {exc}")
        else:
            if old.get("fingerprint") == fingerprint and not opts.force:
                log(f"{output} is up to date (same input, tokenizer and options); --force rebuilds")
                return PrepareResult(output, True, old)
            if not opts.force:
                raise FileExistsError(
                    f"--output {output} holds a dataset built from other input, tokenizer or "
                    "options; pass --force to replace it or choose another --output"
                )
            log(f"--force: rebuilding {output}")

    vocab_size = len(tok)
    dtype = token_dtype(vocab_size)
    key = opts.record_key
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    start = time.perf_counter()
    stats: dict[str, int] = {}
    try:
        writer = IndexedDatasetWriter(tmp, dtype, with_loss_mask=opts.format == "sft")
        total = sources.count_records(spec) if progress else None
        jobs = _jobs(spec, key, opts)
        # The pool forks before the progress bar starts its refresh thread.
        pool = _pool(opts.workers, tok, opts.tokenizer) if opts.workers > 1 else None
        try:
            if pool is None:
                tk._TOKENIZER = tok
                results: Iterator[tk.ChunkResult] = map(tk.encode_chunk, jobs)
            else:
                results = _ordered_bounded(pool, jobs, 2 * opts.workers)
            with _progress(total, progress) as advance:
                for res in results:  # input order, so the output does not depend on workers
                    writer.add(res.tokens, res.lengths, res.mask)
                    for k, v in res.stats.items():
                        stats[k] = stats.get(k, 0) + v
                    advance(res.stats["records"])
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
        num_docs, num_tokens = writer.close()
        dropped = _dropped_records(stats, key or "messages")
        if num_docs == 0:
            raise ValueError(
                f"{opts.input}: no documents left after tokenising "
                f"({dropped or stats}); check the input, the text key and --max-seq-len / "
                "--sft-overflow"
            )
        if dropped:
            log(f"{opts.input}: {dropped}")
        manifest = {
            "format_version": FORMAT_VERSION,
            "kind": opts.format,
            "dtype": dtype.name,
            "vocab_size": vocab_size,
            "num_docs": num_docs,
            "num_tokens": num_tokens,
            "has_loss_mask": opts.format == "sft",
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "tokenizer_path": str(opts.tokenizer.resolve()),
            "fingerprint": fingerprint,
            "report": stats,
            "build_seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _swap_into_place(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(output, False, manifest)


def _dropped_records(stats: dict[str, int], key: str) -> str:
    """What was left out of ``stats['records']`` and why, or "" when nothing was."""
    reasons = {
        "skipped_null": f"with a null {key!r}",
        "skipped_empty": f"with an empty {key!r}",
        "dropped_overflow": "too long (--sft-overflow=drop)",
        "dropped_no_assistant": "without an assistant turn",
    }
    parts = [f"{stats[k]:,} {why}" for k, why in reasons.items() if stats.get(k)]
    if not parts:
        return ""
    return (
        f"{sum(stats[k] for k in reasons if stats.get(k)):,} of {stats.get('records', 0):,} "
        f"records left out ({', '.join(parts)})"
    )


def _ordered_bounded(pool: Any, jobs: Iterator[Any], depth: int) -> Iterator[tk.ChunkResult]:
    # Pool.imap would drain the whole input into its task queue (all text in memory);
    # keeping `depth` chunks in flight bounds memory and still keeps every worker busy.
    pending: collections.deque[Any] = collections.deque()
    for job in jobs:
        pending.append(pool.apply_async(tk.encode_chunk, (job,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _pool(workers: int, tok: Any, tokenizer_dir: Path) -> Any:
    # fork hands workers the loaded tokenizer (spawn re-imports transformers in every worker:
    # seconds each). The parent has only run single, non-batched encodes, so the tokenizers
    # thread pool is unused; the env var keeps the children from starting one of their own.
    if "fork" in mp.get_all_start_methods():
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        tk._TOKENIZER = tok
        return mp.get_context("fork").Pool(workers)
    return mp.get_context("spawn").Pool(workers, tk.init_worker, (str(tokenizer_dir),))


def _swap_into_place(tmp: Path, output: Path) -> None:
    # rename() is atomic for a free name; an existing output is moved aside first, so at
    # every moment `output` is either absent or a complete dataset.
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        output.rename(old)
    tmp.rename(output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
