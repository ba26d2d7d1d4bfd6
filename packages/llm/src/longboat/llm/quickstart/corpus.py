"""A small text corpus from the files the installed longboat packages ship.

Every wheel carries its Python sources and YAML configs, so the quickstart needs no download:
the documents are blocks of those files (split at blank lines into pieces of at most
``block_chars`` characters), in sorted path order so every machine builds the same corpus.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

SUFFIXES = (".py", ".md", ".yaml", ".txt")


def shipped_files() -> list[Path]:
    """Text files of every installed ``longboat.*`` package, sorted by their package path."""
    import longboat

    found: dict[str, Path] = {}
    for root in (Path(p) for p in longboat.__path__):
        for path in root.rglob("*"):
            if path.suffix in SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                found.setdefault(path.relative_to(root).as_posix(), path)
    return [found[k] for k in sorted(found)]


def _blocks(text: str, block_chars: int) -> Iterator[str]:
    block: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        if size and size + len(para) > block_chars:
            yield "\n\n".join(block)
            block, size = [], 0
        block.append(para)
        size += len(para) + 2
    if block and "".join(block).strip():
        yield "\n\n".join(block)


def build_corpus(max_chars: int, *, block_chars: int = 1200) -> list[str]:
    """Documents (text blocks) of the shipped files, at most ``max_chars`` characters in all."""
    docs: list[str] = []
    total = 0
    for path in shipped_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for block in _blocks(text, block_chars):
            if total + len(block) > max_chars:
                return docs
            if block.strip():
                docs.append(block)
                total += len(block)
    return docs
