"""The memory-mapped indexed token dataset that ``data prepare`` writes.

A dataset directory holds:

- ``tokens.bin``: every document's token ids back to back (``uint16`` when the vocabulary
  fits, else ``uint32``);
- ``offsets.bin``: ``int64`` ``[docs + 1]`` document boundaries into ``tokens.bin``;
- ``loss_mask.bin`` (SFT only): ``uint8`` per token, 1 on tokens the loss trains on;
- ``manifest.json``: written *last*; format, dtype, counts, fingerprints of the input and the
  tokenizer, and the build report. A directory without it is not a finished dataset.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FORMAT_VERSION",
    "IncompleteDatasetError",
    "IndexedDatasetWriter",
    "IndexedTokenDataset",
    "read_manifest",
    "token_dtype",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENS, OFFSETS, LOSS_MASK = "tokens.bin", "offsets.bin", "loss_mask.bin"


class IncompleteDatasetError(FileNotFoundError):
    """The directory has no (readable) manifest: a build that never finished."""


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab <= 65536), else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of dataset dir ``path``; :class:`IncompleteDatasetError` when absent/corrupt."""
    file = Path(path) / MANIFEST
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"dataset dir {path} does not exist; run `longboat-llm data prepare`"
        )
    if not file.is_file():
        raise IncompleteDatasetError(
            f"{path} is not a finished dataset: no {MANIFEST} (an interrupted or foreign "
            "build); rerun `longboat-llm data prepare` for it"
        )
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        msg = f"{file} is not valid JSON ({exc}); rebuild the dataset"
        raise IncompleteDatasetError(msg) from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise IncompleteDatasetError(
            f"{file}: format_version={manifest.get('format_version')!r}, this longboat reads "
            f"{FORMAT_VERSION}; rebuild the dataset with `longboat-llm data prepare --force`"
        )
    return manifest


class IndexedDatasetWriter:
    """Appends documents to the three binary files of a dataset directory."""

    def __init__(self, directory: Path, dtype: np.dtype, *, with_loss_mask: bool) -> None:
        self.directory = directory
        self.dtype = np.dtype(dtype)
        self._tokens = (directory / TOKENS).open("wb")
        self._mask = (directory / LOSS_MASK).open("wb") if with_loss_mask else None
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append a chunk: concatenated ``tokens`` of documents with ``lengths``."""
        if len(tokens) and int(np.max(tokens)) > np.iinfo(self.dtype).max:
            raise ValueError(
                f"token id {int(np.max(tokens))} does not fit {self.dtype.name}: the tokenizer "
                "produced an id beyond its reported vocabulary size"
            )
        self._tokens.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        if self._mask is not None:
            if mask is None or len(mask) != len(tokens):
                raise ValueError("an SFT chunk needs one loss-mask value per token")
            self._mask.write(np.ascontiguousarray(mask, dtype=np.uint8).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        self.num_tokens += len(tokens)

    def close(self) -> tuple[int, int]:
        """Write the offsets, fsync everything; returns ``(num_docs, num_tokens)``."""
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        with (self.directory / OFFSETS).open("wb") as fh:
            fh.write(offsets.tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        for fh in (self._tokens, self._mask):
            if fh is not None:
                fh.flush()
                os.fsync(fh.fileno())
                fh.close()
        return len(lengths), int(offsets[-1])


class _MaskedDocuments:
    """``{"input_ids", "loss_mask"}`` per document (what packing takes for SFT)."""

    def __init__(self, ds: IndexedTokenDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": self.ds[i], "loss_mask": self.ds.loss_mask(i)}

    def lengths(self) -> np.ndarray:
        return self.ds.lengths()


class IndexedTokenDataset(Sequence[np.ndarray]):
    """Read a prepared dataset (memory-mapped): ``ds[i]`` is document ``i``'s token ids.

    The index is validated against the files on open; a truncated or corrupt file raises a
    ``ValueError`` naming it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.num_docs = int(self.manifest["num_docs"])
        self.num_tokens = int(self.manifest["num_tokens"])
        self.offsets = self._map(OFFSETS, np.int64, self.num_docs + 1)
        self.tokens = self._map(TOKENS, self.dtype, self.num_tokens)
        self._mask = (
            self._map(LOSS_MASK, np.uint8, self.num_tokens)
            if self.manifest.get("has_loss_mask")
            else None
        )
        off = self.offsets
        if off[0] != 0 or off[-1] != self.num_tokens or np.any(np.diff(off) < 0):
            raise ValueError(
                f"{self.path / OFFSETS} is corrupt: offsets must rise from 0 to num_tokens="
                f"{self.num_tokens}; rebuild with `longboat-llm data prepare --force`"
            )

    def _map(self, name: str, dtype: Any, count: int) -> np.ndarray:
        file = self.path / name
        if not file.is_file():
            raise ValueError(f"{file} is missing; rebuild with `longboat-llm data prepare --force`")
        size, want = file.stat().st_size, count * np.dtype(dtype).itemsize
        if size != want:
            raise ValueError(
                f"{file} has {size} bytes but the manifest implies {want} ({count} x "
                f"{np.dtype(dtype).name}): truncated or corrupt; rebuild with "
                "`longboat-llm data prepare --force`"
            )
        if count == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(file, dtype=dtype, mode="r", shape=(count,))

    def __len__(self) -> int:
        return self.num_docs

    def __getitem__(self, index: int) -> np.ndarray:  # type: ignore[override]
        if not -self.num_docs <= index < self.num_docs:
            raise IndexError(f"document {index} outside [0, {self.num_docs})")
        index %= self.num_docs
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    def lengths(self) -> np.ndarray:
        """Tokens per document (from the index; no token reads)."""
        return np.diff(self.offsets)

    @property
    def has_loss_mask(self) -> bool:
        """Whether the dataset is SFT (carries a per-token loss mask)."""
        return self._mask is not None

    @property
    def num_loss_tokens(self) -> int:
        """Tokens the loss trains on (SFT: masked-in tokens; pretraining: all)."""
        if self._mask is None:
            return self.num_tokens
        return int(np.asarray(self._mask, dtype=np.int64).sum())

    def loss_mask(self, index: int) -> np.ndarray:
        """Per-token loss mask of document ``index`` (all ones for pretraining data)."""
        if self._mask is None:
            return np.ones(len(self[index]), dtype=np.uint8)
        index %= self.num_docs
        return self._mask[self.offsets[index] : self.offsets[index + 1]]

    def documents(self) -> Sequence[Any]:
        """Documents as packing takes them: dicts with the loss mask for SFT, else arrays."""
        return _MaskedDocuments(self) if self.has_loss_mask else self
