"""Input sources for ``data prepare``: JSONL, Parquet, plain text (``.txt``: one document per
paragraph, paragraphs separated by blank lines) or a local Hugging Face ``datasets`` dir.

:func:`resolve_input` finds the files and their kind; :func:`iter_record_chunks` streams
records in chunks (only the needed column, or whole records for SFT), and :func:`first_record` checks the input is
non-empty and has the key before any tokenising starts.

A ``datasets`` directory (``save_to_disk``) is ``data-*.arrow`` (Arrow IPC *stream* files)
plus ``dataset_info.json`` / ``state.json``. It is read straight from the Arrow files with
pyarrow: the ``datasets`` package is not needed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["InputSpec", "count_records", "first_record", "iter_record_chunks", "resolve_input"]

Kind = Literal["jsonl", "parquet", "hf_dir", "text"]
_SUFFIX: dict[str, Kind] = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".txt": "text",
}


@dataclass(frozen=True)
class InputSpec:
    """What ``--input`` points at: its kind, its files (sorted) and the path given."""

    kind: Kind
    files: tuple[Path, ...]
    root: Path

    def fingerprint(self) -> list[dict[str, Any]]:
        """Path, size and mtime of every input file (what a rerun compares)."""
        out = []
        for f in self.files:
            st = f.stat()
            out.append({"path": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        return out


def _is_hf_dir(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_info.json").is_file()


HUB_PREFIX = "hf://datasets/"
"""``data.paths`` entries naming a Hugging Face dataset: ``hf://datasets/<owner>/<name>``."""


def hub_dataset_id(path: str | Path) -> str | None:
    """The dataset id of an ``hf://datasets/<owner>/<name>`` entry (also as ``Path`` makes
    it, with one slash), else None."""
    text = str(path)
    for prefix in (HUB_PREFIX, HUB_PREFIX.replace("//", "/", 1)):
        if text.startswith(prefix):
            return text[len(prefix) :].strip("/")
    return None


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of Hugging Face dataset ``repo_id``: the hub cache's
    (``HF_HUB_CACHE``, as ``huggingface_hub`` lays it out) when it holds one, else downloaded
    into it (data files only)."""
    import os

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    kw: dict[str, Any] = {"repo_type": "dataset", "cache_dir": os.environ.get("HF_HUB_CACHE")}
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, **kw))
    except LocalEntryNotFoundError:
        pass
    patterns = ["*.jsonl", "*.json", "*.parquet", "*.txt", "*.arrow", "*/*", "*/*/*"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, **kw))
    except Exception as exc:  # hub errors come in many kinds: one line naming the id
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FileNotFoundError(
            f"{HUB_PREFIX}{repo_id}: not in the hub cache and not downloadable ({reason}); "
            "check the id, or download it first (huggingface-cli download --repo-type dataset)"
        ) from None


def _hub_input(repo_id: str) -> InputSpec:
    """The data files of a hub dataset snapshot: its train split's where files name one
    (``train`` in the file or folder name), else all, of one kind."""
    root = hub_snapshot(repo_id)
    files = sorted(
        f for f in root.rglob("*") if f.is_file() and f.suffix in _SUFFIX
        and not any(part.startswith(".") for part in f.relative_to(root).parts)
        and f.name != "dataset_infos.json"
    )  # fmt: skip
    train = [f for f in files if "train" in str(f.relative_to(root)).lower()]
    files = train or files
    kinds = {_SUFFIX[f.suffix] for f in files}
    if len(kinds) != 1:
        what = "no .jsonl/.parquet/.txt files" if not kinds else f"mixed kinds {sorted(kinds)}"
        raise ValueError(f"{HUB_PREFIX}{repo_id} ({root}) holds {what}")
    return InputSpec(kinds.pop(), tuple(files), root)


def resolve_input(path: str | Path) -> InputSpec:
    """Classify ``path`` (a file, a folder of JSONL / Parquet / .txt files, a ``datasets``
    dir, or a Hugging Face dataset ``hf://datasets/<owner>/<name>``)."""
    repo_id = hub_dataset_id(path)
    if repo_id is not None:
        return _hub_input(repo_id)
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(
            f"{root} does not exist; pass a JSONL / Parquet / .txt file or folder"
        )
    if root.is_file():
        kind = _SUFFIX.get(root.suffix)
        if kind is None:
            raise ValueError(
                f"{root}: unknown file type {root.suffix!r}; use .jsonl, .json (JSON "
                "lines), .parquet or .txt, or a Hugging Face datasets directory"
            )
        return InputSpec(kind, (root,), root)
    if (root / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise ValueError(
            f"{root} is a DatasetDict with splits {splits}; pass one split's folder, "
            f"e.g. {root / (splits[0] if splits else 'train')}"
        )
    if _is_hf_dir(root):
        arrows = tuple(sorted(root.glob("data-*.arrow")) or sorted(root.glob("*.arrow")))
        if not arrows:
            raise ValueError(f"{root} looks like a datasets dir but has no *.arrow files")
        return InputSpec("hf_dir", arrows, root)
    found: dict[Kind, list[Path]] = {}
    for f in sorted(root.iterdir()):
        if f.is_file() and f.suffix in _SUFFIX:
            found.setdefault(_SUFFIX[f.suffix], []).append(f)
    if len(found) != 1:
        what = "no .jsonl/.parquet/.txt files" if not found else f"mixed kinds {sorted(found)}"
        raise ValueError(f"{root} holds {what}; give a folder of one kind of file")
    kind, files = next(iter(found.items()))
    return InputSpec(kind, tuple(files), root)


def _decode_line(f: Path, lineno: int, raw: bytes) -> str:
    """A JSONL line as text; ``ValueError`` naming the file, line and column when it is not
    UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{f}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
            f"{exc.start + 1}: {exc.reason}); re-encode the file as UTF-8"
        ) from None


Convert = Callable[[Any, str], Any]
"""Turns one record (or its ``key`` value) into what is tokenised, given where it is
(``file:line`` or ``file row n``) for its errors."""


def _jsonl_chunks(
    spec: InputSpec, key: str | None, size: int, convert: Convert | None = None
) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for f in spec.files:
        with f.open("rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                line = _decode_line(f, lineno, raw)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{f}:{lineno}: not valid JSON ({exc.msg})") from None
                if key is not None and (not isinstance(record, dict) or key not in record):
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(
                        f"{f}:{lineno}: record has no key {key!r} (keys: {keys}); "
                        "name the text key (data.columns={text: <key>}, --text-key) or use chat records (sft)"
                    )
                value = record if key is None else record[key]
                chunk.append(value if convert is None else convert(value, f"{f}:{lineno}"))
                if len(chunk) == size:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


def _check_column(f: Path, names: list[str], key: str) -> None:
    if key not in names:
        raise ValueError(
            f"{f}: no column {key!r} (columns: {names}); name the text column "
            "(data.columns={text: <column>}, --text-key) or use chat columns (sft)"
        )


def _unreadable(f: Path, what: str, exc: BaseException, where: str = "") -> ValueError:
    """A library's read error as one line naming the file (and the rows it reached)."""
    lines = str(exc).strip().splitlines()
    reason = lines[0] if lines else type(exc).__name__
    return ValueError(
        f"{f}: unreadable {what}{where} ({reason}); the file is damaged or truncated: "
        "restore or rewrite it"
    )


def _parquet_file(f: Path) -> Any:
    """``pyarrow.parquet.ParquetFile`` of ``f``; ``ValueError`` naming it when unreadable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(f, "Parquet file", exc) from None


def _rows(batch: Any, key: str | None) -> list[Any]:
    """A record batch's ``key`` column, or its rows as dicts (``key`` None)."""
    if key is None:
        return list(batch.to_pylist())
    return list(batch.column(batch.schema.get_field_index(key)).to_pylist())


def _converted(values: list[Any], f: Path, first: int, convert: Convert | None) -> list[Any]:
    if convert is None:
        return values
    return [convert(v, f"{f} row {first + i}") for i, v in enumerate(values)]


def _parquet_chunks(
    spec: InputSpec, key: str | None, size: int, convert: Convert | None = None
) -> Iterator[list[Any]]:
    import pyarrow as pa

    for f in spec.files:
        pf = _parquet_file(f)
        if key is not None:
            _check_column(f, pf.schema_arrow.names, key)
        row = 0
        batches = pf.iter_batches(batch_size=size, columns=None if key is None else [key])
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as exc:
                raise _unreadable(f, "Parquet file", exc, f" after row {row}") from None
            if batch is None:
                break
            yield _converted(_rows(batch, key), f, row, convert)
            row += batch.num_rows


def _arrow_batches(f: Path) -> Iterator[Any]:
    import pyarrow as pa

    try:
        with pa.memory_map(str(f), "r") as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:  # some writers use the IPC file format
                source.seek(0)
                reader = pa.ipc.open_file(source)
                yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
                return
            yield from reader
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(f, "Arrow file", exc) from None


def _hf_chunks(
    spec: InputSpec, key: str | None, size: int, convert: Convert | None = None
) -> Iterator[list[Any]]:
    # The Arrow files a ``datasets`` folder holds are read with pyarrow: no ``datasets``
    # package needed, and the same rows in the same order as ``load_from_disk``.
    for f in spec.files:
        chunk: list[Any] = []
        row = 0
        for batch in _arrow_batches(f):
            if key is not None:
                _check_column(f, batch.schema.names, key)
            chunk.extend(_converted(_rows(batch, key), f, row, convert))
            row += batch.num_rows
            while len(chunk) >= size:
                yield chunk[:size]
                chunk = chunk[size:]
        if chunk:
            yield chunk


def _paragraphs(f: Path) -> list[str]:
    """The documents of a ``.txt`` file: its paragraphs (text between blank lines)."""
    import re

    raw = f.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ValueError(
            f"{f}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}: {exc.reason}); "
            "re-encode the file as UTF-8"
        ) from None
    return [p.strip() for p in re.split(r"\n[ \t\r]*\n", text) if p.strip()]


def _text_chunks(
    spec: InputSpec, key: str | None, size: int, convert: Convert | None = None
) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for f in spec.files:
        for i, paragraph in enumerate(_paragraphs(f)):
            if key not in (None, "text"):
                raise ValueError(
                    f"{f}: a .txt file holds plain text, not records with a {key!r} key; "
                    "train it as pretraining text (data.format=pretrain, no text key mapping)"
                )
            value = {"text": paragraph} if key is None else paragraph
            chunk.append(value if convert is None else convert(value, f"{f} paragraph {i}"))
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def iter_record_chunks(
    spec: InputSpec, key: str | None, chunk_size: int = 512, convert: Convert | None = None
) -> Iterator[list[Any]]:
    """Values of ``key`` for every record (``key`` None: the whole records), in input order,
    ``chunk_size`` at a time; each through ``convert`` when given."""
    reader = {
        "jsonl": _jsonl_chunks,
        "parquet": _parquet_chunks,
        "hf_dir": _hf_chunks,
        "text": _text_chunks,
    }[spec.kind]
    return reader(spec, key, chunk_size, convert)


def count_records(spec: InputSpec) -> int | None:
    """Number of records when cheap to know (Parquet metadata, Arrow batches, JSONL lines)."""
    if spec.kind == "parquet":
        return sum(_parquet_file(f).metadata.num_rows for f in spec.files)
    if spec.kind == "hf_dir":
        return sum(b.num_rows for f in spec.files for b in _arrow_batches(f))
    if spec.kind == "text":
        return sum(len(_paragraphs(f)) for f in spec.files)
    total = 0
    for f in spec.files:
        with f.open("rb") as fh:
            total += sum(1 for line in fh if line.strip())
    return total


def first_record(spec: InputSpec, key: str | None, convert: Convert | None = None) -> Any:
    """The first record's ``key`` value (None: the record); raises naming the input when it is
    empty or lacks it."""
    for chunk in iter_record_chunks(spec, key, chunk_size=1, convert=convert):
        return chunk[0]
    raise ValueError(f"{spec.root} holds no records (empty dataset); point it at data with rows")
