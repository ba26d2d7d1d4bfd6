"""What ``data prepare`` encodes: media files and their captions, in a fixed order.

Inputs:

- a **folder**: every video / image under it (recursively, sorted by relative path), each
  captioned by the text of ``<name>.txt`` beside it;
- a **JSONL** file: one object per line with ``path`` and ``caption``;
- a **CSV** file: a header with ``path`` and ``caption`` columns.

Relative paths of a list start at ``root`` (default: the list file's folder). A missing or
empty caption is not an error here: the sample fails when it is prepared, naming the file
(skippable with ``skip_bad_samples``). A malformed list is an error at once.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

from longboat.diffusion.data.errors import DataError
from longboat.diffusion.data.media import IMAGE_SUFFIXES, VIDEO_SUFFIXES

__all__ = ["Source", "list_sources", "sources_fingerprint"]


@dataclass(frozen=True)
class Source:
    """One media file to encode."""

    path: Path
    caption: str | None
    """None when missing or empty."""
    name: str
    """How it is shown and stored (the path as listed, or relative to the input folder)."""
    caption_from: str
    """Where the caption is (or was expected): a sidecar file, or ``<list> line <n>``."""


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
            f"{column}); re-encode the file as UTF-8"
        ) from None


def _from_folder(folder: Path) -> list[Source]:
    media = sorted(
        (
            p
            for p in folder.rglob("*")
            if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES | IMAGE_SUFFIXES
        ),
        key=lambda p: p.relative_to(folder).as_posix(),
    )
    out = []
    for p in media:
        side = p.with_suffix(".txt")
        caption = _utf8_text(side).strip() if side.is_file() else ""
        out.append(Source(p, caption or None, p.relative_to(folder).as_posix(), str(side)))
    return out


def _resolve(raw: str, base: Path) -> Path:
    p = Path(raw).expanduser()
    return p if p.is_absolute() else base / p


def _from_jsonl(file: Path, base: Path) -> list[Source]:
    out = []
    for n, line in enumerate(_utf8_text(file).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{file} line {n}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("path"), str) or not rec["path"]:
            raise DataError(f'{file} line {n}: needs a "path" string (and a "caption")')
        caption = rec.get("caption")
        caption = caption.strip() if isinstance(caption, str) else ""
        out.append(
            Source(_resolve(rec["path"], base), caption or None, rec["path"], f"{file} line {n}")
        )
    return out


def _from_csv(file: Path, base: Path) -> list[Source]:
    with io.StringIO(_utf8_text(file), newline="") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        if "path" not in cols or "caption" not in cols:
            raise DataError(f"{file}: the header has columns {cols}; it needs 'path' and 'caption'")
        out = []
        for row in reader:
            raw = (row.get("path") or "").strip()
            where = f"{file} line {reader.line_num}"
            if not raw:
                raise DataError(f"{where}: empty path")
            caption = (row.get("caption") or "").strip()
            out.append(Source(_resolve(raw, base), caption or None, raw, where))
    return out


def list_sources(input: str | Path, root: str | Path | None = None) -> list[Source]:
    """The media files and captions of ``input`` (a folder, ``.jsonl`` or ``.csv``), in order."""
    path = Path(input).expanduser()
    if path.is_dir():
        sources = _from_folder(path)
    elif not path.is_file():
        raise DataError(f"input={str(input)!r}: no such file or folder")
    else:
        base = Path(root).expanduser() if root is not None else path.parent
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            sources = _from_jsonl(path, base)
        elif suffix == ".csv":
            sources = _from_csv(path, base)
        else:
            raise DataError(
                f"input={str(input)!r}: give a folder of videos / images, a .jsonl or a .csv "
                "list of path, caption"
            )
    if not sources:
        raise DataError(
            f"input={str(input)!r}: no videos or images found (videos: "
            f"{', '.join(sorted(VIDEO_SUFFIXES))}; images: {', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    return sources


def sources_fingerprint(sources: list[Source]) -> str:
    """SHA-256 of the names and captions, in order (a resumed run must see the same list)."""
    h = hashlib.sha256()
    for s in sources:
        h.update(json.dumps([s.name, s.caption]).encode())
        h.update(b"\n")
    return h.hexdigest()
