"""Conversation records with images and videos: LLaVA / ShareGPT JSON, JSON lines, Parquet.

Accepted record shapes (one record per JSON list item, JSONL line or Parquet row):

- LLaVA / ShareGPT: ``{"image": "a.jpg" | [...], "video": ..., "conversations":
  [{"from": "human" | "gpt" | "system", "value": "<image>\\n..."}]}``;
- messages: ``{"images": [...], "videos": [...], "messages": [{"role": "user" |
  "assistant" | "system", "content": "..." | [{"type": "text", "text": ...},
  {"type": "image"}, ...]}]}`` (content parts become text with placeholders in order).

``image`` / ``images`` and ``video`` / ``videos`` hold one item or a list. An image item is
a path (relative to the ``root`` folder, default: the input file's folder; a path leading
outside that folder is refused, so ``data.root`` is also what admits a folder of media),
raw bytes, or a ``{"bytes": ..., "path": ...}`` struct (Parquet's image columns). A video item is a path to
a video file (mp4, read with PyAV) or to a folder of frame images, a list of frame paths,
or embedded bytes. Each ``<image>`` / ``<video>`` placeholder stands for the next item in
order; their counts must equal the items' (:class:`PlaceholderCountError` otherwise).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longboat.vlm.data.errors import DataError, PlaceholderCountError, where

__all__ = [
    "IMAGE_PLACEHOLDER",
    "VIDEO_PLACEHOLDER",
    "Conversation",
    "MediaRef",
    "read_conversations",
]

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}
_SUFFIXES = (".json", ".jsonl", ".parquet")


@dataclass(frozen=True)
class MediaRef:
    """One image or video of a sample: a file or folder, a list of frame files, or bytes."""

    field: str
    """Where it sits in the record, e.g. ``image`` or ``videos[1]``."""
    path: Path | None = None
    """The file (image, video) or folder (video frames), resolved against the root."""
    frames: tuple[Path, ...] | None = None
    """A video given as a list of frame image files."""
    data: bytes | None = None
    """Embedded bytes (Parquet)."""

    def describe(self) -> str:
        """A short name of the media for messages."""
        if self.path is not None:
            return str(self.path)
        if self.frames is not None:
            return f"{len(self.frames)} frame files from {self.frames[0] if self.frames else '-'}"
        return f"<{len(self.data or b'')} embedded bytes>"


@dataclass(frozen=True)
class Conversation:
    """One record: chat turns (``role`` / ``content`` strings) and its media in order."""

    source: str
    """The input file."""
    row: int
    """0-based record index in ``source``."""
    line: int | None
    """1-based line number (JSON lines input only)."""
    messages: tuple[dict[str, str], ...]
    images: tuple[MediaRef, ...]
    videos: tuple[MediaRef, ...]

    @property
    def where(self) -> str:
        """``"<file> row <n>"`` for messages."""
        return where(self.source, self.row, self.line)


def _content_text(content: Any, at: str, turn: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                parts.append(str(part.get("text", "")))
            elif kind == "image":
                parts.append(IMAGE_PLACEHOLDER)
            elif kind == "video":
                parts.append(VIDEO_PLACEHOLDER)
            else:
                raise DataError(
                    f"{at}: turn {turn}: content part {str(part)[:60]!r} is not a "
                    "{'type': 'text' | 'image' | 'video'} dict"
                )
        return "".join(parts)
    raise DataError(f"{at}: turn {turn}: content is {type(content).__name__}, not a string")


def _messages(record: Mapping[str, Any], at: str) -> tuple[dict[str, str], ...]:
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise DataError(
            f"{at}: the record has no 'conversations' or 'messages' (keys: {sorted(record)}); "
            "use LLaVA/ShareGPT 'conversations' [{from, value}] or 'messages' [{role, content}]"
        )
    if isinstance(turns, str):  # Parquet writers sometimes store the turns as JSON text
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError:
            raise DataError(f"{at}: the turns are a string that is not JSON") from None
    if not isinstance(turns, Sequence) or not turns:
        raise DataError(f"{at}: the turns must be a non-empty list, got {str(turns)[:60]!r}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or role_key not in turn or text_key not in turn:
            raise DataError(
                f"{at}: turn {i} must be a dict with {role_key!r} and {text_key!r}, got "
                f"{str(turn)[:60]!r}"
            )
        role = _ROLES.get(str(turn[role_key]).lower())
        if role is None:
            raise DataError(
                f"{at}: turn {i}: role {turn[role_key]!r} is not one of {sorted(_ROLES)}"
            )
        out.append({"role": role, "content": _content_text(turn[text_key], at, i)})
    return tuple(out)


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def _items(record: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, Any]:
    for key in keys:
        if record.get(key) is not None:
            return key, record[key]
    return keys[0], None


def _resolve(root: Path, name: str, field: str, at: str) -> Path:
    """``name`` against ``root``; a path that leads outside ``root`` (``..``, an absolute path
    elsewhere) is refused, so a record cannot make training read any file of the machine."""
    p = Path(name)
    path = p if p.is_absolute() else root / p
    base = os.path.abspath(root)
    if os.path.commonpath([base, os.path.abspath(path)]) != base:
        raise DataError(
            f"{at}: field {field!r}: {name!r} resolves to {os.path.abspath(path)}, outside the "
            f"media root {base}; media paths must lie under it: move the file there, or set "
            "data.root to a folder that holds every media file"
        )
    return path


def _image_ref(item: Any, field: str, root: Path, at: str) -> MediaRef:
    if isinstance(item, Mapping):
        data, path = item.get("bytes"), item.get("path")
        if data is not None:
            return MediaRef(field, data=bytes(data))
        if path:
            return MediaRef(field, path=_resolve(root, str(path), field, at))
    elif isinstance(item, bytes | bytearray | memoryview):
        return MediaRef(field, data=bytes(item))
    elif isinstance(item, str) and item:
        return MediaRef(field, path=_resolve(root, item, field, at))
    raise DataError(
        f"{at}: field {field!r}: {str(item)[:60]!r} is not a path, bytes or a "
        "{'bytes', 'path'} struct"
    )


def _is_frame_list(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(f, str) and f.lower().endswith(IMAGE_SUFFIXES) for f in value)
    )


def _video_ref(item: Any, field: str, root: Path, at: str) -> MediaRef:
    if _is_frame_list(item):
        return MediaRef(
            field, frames=tuple(_resolve(root, f, f"{field}[{i}]", at) for i, f in enumerate(item))
        )
    return _image_ref(item, field, root, at)


def _listed(value: Any) -> bool:
    return isinstance(value, list | tuple)


def _media(
    record: Mapping[str, Any], root: Path, at: str
) -> tuple[tuple[MediaRef, ...], tuple[MediaRef, ...]]:
    key, value = _items(record, ("image", "images"))
    items = list(value) if _listed(value) else ([] if value is None else [value])
    images = tuple(
        _image_ref(x, f"{key}[{i}]" if _listed(value) else key, root, at)
        for i, x in enumerate(items)
    )
    key, value = _items(record, ("video", "videos"))
    # "video": [frame.jpg, ...] is one video given as frames; otherwise a list is many videos.
    if _is_frame_list(value) and key == "video":
        return images, (_video_ref(value, key, root, at),)
    items = list(value) if _listed(value) else ([] if value is None else [value])
    videos = tuple(
        _video_ref(x, f"{key}[{i}]" if _listed(value) else key, root, at)
        for i, x in enumerate(items)
    )
    return images, videos


def _check_placeholders(conv: Conversation) -> None:
    for token, refs, what in (
        (IMAGE_PLACEHOLDER, conv.images, "image"),
        (VIDEO_PLACEHOLDER, conv.videos, "video"),
    ):
        n = sum(m["content"].count(token) for m in conv.messages)
        if n != len(refs):
            raise PlaceholderCountError(
                f"{conv.where}: {n} {token} placeholder(s) in the turns but {len(refs)} "
                f"{what}(s) in the record; put one {token} where each {what} goes"
            )


def _utf8_text(path: Path) -> str:
    """The file's text; ``DataError`` naming the line and column of the first byte that is
    not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(
            f"{path} line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column "
            f"{column}: {exc.reason}); re-encode the file as UTF-8"
        ) from None


def _parquet_records(path: Path) -> Iterator[tuple[int, int | None, Any]]:
    """``(row, None, record)`` of a Parquet file; ``DataError`` naming the file and the rows
    read when it is damaged or truncated."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=256)
        for batch in batches:
            records = batch.to_pylist()
            for record in records:
                yield row, None, record
                row += 1
    except (pa.ArrowException, OSError) as exc:
        lines = str(exc).strip().splitlines()
        reason = lines[0] if lines else type(exc).__name__
        after = f" after row {row - 1}" if row else ""
        raise DataError(
            f"{path}: unreadable Parquet file{after} ({reason}); the file is damaged or "
            "truncated: restore or rewrite it"
        ) from None


def _records(path: Path) -> Iterator[tuple[int, int | None, Any]]:
    """``(row, line, record)`` of every record of one file."""
    if path.suffix == ".parquet":
        yield from _parquet_records(path)
        return
    text = _utf8_text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        yield from ((i, None, r) for i, r in enumerate(records))
        return
    row = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{where(str(path), row, lineno)}: not valid JSON ({exc.msg})"
            ) from None
        yield row, lineno, record
        row += 1


def _files(path: Path) -> list[Path]:
    if not path.exists():
        raise DataError(f"data path {path} does not exist; pass a .json/.jsonl/.parquet file")
    if path.is_file():
        if path.suffix not in _SUFFIXES:
            raise DataError(f"{path}: unknown file type {path.suffix!r}; use one of {_SUFFIXES}")
        return [path]
    files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in _SUFFIXES)
    if not files:
        raise DataError(f"{path} holds no .json/.jsonl/.parquet files")
    return files


def read_conversations(path: str | Path, *, root: str | Path | None = None) -> list[Conversation]:
    """Every record of ``path`` (a file or a folder of them, sorted) as a :class:`Conversation`.

    Media paths resolve against ``root`` (default: each file's folder). A malformed record or
    a placeholder count that differs from the record's media raises naming its row; missing
    or corrupt media are found later, when the samples are encoded.
    """
    out = []
    for f in _files(Path(path)):
        base = Path(root) if root is not None else f.parent
        for row, line, record in _records(f):
            at = where(str(f), row, line)
            if not isinstance(record, Mapping):
                raise DataError(
                    f"{at}: a record must be a JSON object, got {type(record).__name__}"
                )
            images, videos = _media(record, base, at)
            conv = Conversation(str(f), row, line, _messages(record, at), images, videos)
            _check_placeholders(conv)
            out.append(conv)
    return out
