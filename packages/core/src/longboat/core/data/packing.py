"""Sequence packing: documents into fixed-length rows that attention never crosses.

A *plan* assigns document pieces to rows (:func:`plan_packing`); :func:`build_row` turns one
row's pieces into model inputs:

- ``input_ids`` ``[seq_len]``: the pieces back to back, then ``pad_id``;
- ``position_ids`` ``[seq_len]``: restart at 0 for every piece (padding counts on from 0 too);
- ``labels`` ``[seq_len]``: the next token *inside the same piece*; the last token of each
  piece, padding, and tokens whose target is masked out get ``ignore_index``, so no label
  crosses a document boundary;
- ``loss_mask`` ``[seq_len]`` float: 1 where ``labels`` counts;
- ``cu_seqlens`` ``[pieces + 2]`` int32: piece offsets (flash-attn's varlen convention), with
  the padding as one last segment so ``cu_seqlens[-1] == seq_len``.

A document longer than ``seq_len`` is split into ``seq_len``-sized pieces; each piece is its
own sequence (positions restart, and the one label across the cut is dropped).

A document's optional ``loss_mask`` marks the tokens that are *targets* (SFT: assistant
tokens): the label at position ``i`` is token ``i + 1``, so it counts where
``loss_mask[i + 1]`` is set.

:class:`PackedDataset` is a map-style dataset of packed rows with a deterministic plan, and a
resumable iterator (``state_dict`` / ``load_state_dict``); :func:`collate_packed` stacks rows
into a batch with one flat ``cu_seqlens`` over the flattened ``[batch * seq_len]`` tokens.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

__all__ = [
    "IGNORE_INDEX",
    "PackedDataset",
    "Piece",
    "build_row",
    "collate_packed",
    "document_lengths",
    "plan_packing",
    "plan_unpacked",
]

IGNORE_INDEX = -100
Strategy = Literal["best_fit", "greedy"]


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, stop)`` of document ``doc``."""

    doc: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        """Number of tokens in the piece."""
        return self.stop - self.start


def _split(lengths: Sequence[int], seq_len: int) -> list[Piece]:
    pieces: list[Piece] = []
    for doc, n in enumerate(lengths):
        n = int(n)
        for start in range(0, n, seq_len):
            pieces.append(Piece(doc, start, min(start + seq_len, n)))
    return pieces


def plan_packing(
    lengths: Sequence[int] | np.ndarray, seq_len: int, *, strategy: Strategy = "best_fit"
) -> list[list[Piece]]:
    """Assign documents of ``lengths`` to rows of ``seq_len`` tokens.

    ``best_fit``: best-fit decreasing (pieces longest first, each into the fullest row that
    still has room; deterministic, ties by document index) — few padding tokens.
    ``greedy``: pieces in document order, a new row when the next one does not fit — keeps
    the order. Empty documents are skipped.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    pieces = _split(lengths, seq_len)
    rows: list[list[Piece]] = []
    if strategy == "greedy":
        used = seq_len
        for p in pieces:
            if used + p.length > seq_len:
                rows.append([])
                used = 0
            rows[-1].append(p)
            used += p.length
        return rows
    if strategy != "best_fit":
        raise ValueError(f"strategy={strategy!r} is not one of 'best_fit', 'greedy'")
    pieces.sort(key=lambda p: (-p.length, p.doc, p.start))
    # Sorted (free, row) keys: the first key with free >= length is the best fit.
    free: list[tuple[int, int]] = []
    for p in pieces:
        at = bisect.bisect_left(free, (p.length, -1))
        if at == len(free):
            rows.append([p])
            row, left = len(rows) - 1, seq_len - p.length
        else:
            left, row = free.pop(at)
            rows[row].append(p)
            left -= p.length
        if left > 0:
            bisect.insort(free, (left, row))
    for row in rows:  # document order inside a row: reproducible and easy to read
        row.sort(key=lambda p: (p.doc, p.start))
    return rows


def plan_unpacked(lengths: Sequence[int] | np.ndarray, seq_len: int) -> list[list[Piece]]:
    """One piece per row (padded), for comparison with packing; long documents are split."""
    return [[p] for p in _split(lengths, seq_len)]


def _doc_parts(item: Any) -> tuple[np.ndarray, np.ndarray | None]:
    if isinstance(item, Mapping):
        tokens = item["input_ids"] if "input_ids" in item else item["tokens"]
        mask = item.get("loss_mask")
        return np.asarray(tokens), None if mask is None else np.asarray(mask)
    return np.asarray(item), None


def build_row(
    pieces: Sequence[Piece],
    documents: Sequence[Any],
    seq_len: int,
    *,
    pad_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, np.ndarray]:
    """Model inputs of one row (keys in the module doc) from its pieces.

    ``documents[i]`` is a token array, or a mapping with ``input_ids`` (or ``tokens``) and an
    optional per-token ``loss_mask``.
    """
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, ignore_index, dtype=np.int64)
    loss_mask = np.zeros(seq_len, dtype=np.float32)
    position_ids = np.zeros(seq_len, dtype=np.int64)
    cu = [0]
    at = 0
    for p in pieces:
        tokens, mask = _doc_parts(documents[p.doc])
        tok = tokens[p.start : p.stop].astype(np.int64)
        n = len(tok)
        if n != p.length or at + n > seq_len:
            raise ValueError(
                f"document {p.doc} has {len(tokens)} tokens, the packing plan expected "
                f"piece [{p.start}, {p.stop}) in a row of {seq_len}: the plan was built for "
                "other documents; rebuild it"
            )
        input_ids[at : at + n] = tok
        position_ids[at : at + n] = np.arange(n)
        target_ok = np.ones(n - 1, dtype=bool) if mask is None else mask[p.start + 1 : p.stop] > 0
        lab = np.where(target_ok, tok[1:], ignore_index)
        labels[at : at + n - 1] = lab
        loss_mask[at : at + n - 1] = target_ok
        at += n
        cu.append(at)
    if at < seq_len:
        position_ids[at:] = np.arange(seq_len - at)
        cu.append(seq_len)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "cu_seqlens": np.asarray(cu, dtype=np.int32),
    }


def document_lengths(documents: Sequence[Any]) -> np.ndarray:
    """Token count per document: ``documents.lengths()`` when it has one, else by reading."""
    lengths = getattr(documents, "lengths", None)
    if callable(lengths):
        return np.asarray(lengths(), dtype=np.int64)
    return np.asarray([len(_doc_parts(documents[i])[0]) for i in range(len(documents))])


class PackedDataset(torch.utils.data.Dataset):
    """Rows of ``seq_len`` packed from ``documents`` (map-style, plus a resumable iterator).

    Args:
        documents: a sequence of documents (see :func:`build_row`); ``lengths()`` is used
            when present so planning does not read the tokens.
        seq_len: tokens per row.
        strategy: ``best_fit`` or ``greedy`` (:func:`plan_packing`).
        packed: ``False`` gives one document piece per row (padded) instead.
        pad_id: token id of padding (never a label).
        ignore_index: label value that the loss skips.
    """

    def __init__(
        self,
        documents: Sequence[Any],
        seq_len: int,
        *,
        strategy: Strategy = "best_fit",
        packed: bool = True,
        pad_id: int = 0,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        self.documents = documents
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.ignore_index = ignore_index
        lengths = document_lengths(documents)
        self.rows = (
            plan_packing(lengths, seq_len, strategy=strategy)
            if packed
            else plan_unpacked(lengths, seq_len)
        )
        if not self.rows:
            raise ValueError("PackedDataset: the documents hold no tokens; nothing to pack")
        self.num_tokens = int(lengths.sum())
        self._position = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return build_row(
            self.rows[index],
            self.documents,
            self.seq_len,
            pad_id=self.pad_id,
            ignore_index=self.ignore_index,
        )

    @property
    def fill(self) -> float:
        """Fraction of row slots holding tokens (1.0 = no padding)."""
        return self.num_tokens / (len(self.rows) * self.seq_len)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """Rows from the saved position to the end; the next pass starts from 0."""
        while self._position < len(self.rows):
            row = self[self._position]
            self._position += 1
            yield row
        self._position = 0

    def state_dict(self) -> dict[str, Any]:
        """Iterator position plus the plan's shape (checked on load)."""
        return {"position": self._position, "rows": len(self.rows), "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue iteration where ``state`` was saved (same documents and plan)."""
        if state["rows"] != len(self.rows) or state["seq_len"] != self.seq_len:
            raise ValueError(
                f"packed-data state is for {state['rows']} rows of {state['seq_len']} tokens, "
                f"this dataset has {len(self.rows)} rows of {self.seq_len}: resume with the same "
                "documents, seq_len and strategy"
            )
        self._position = int(state["position"])


def collate_packed(rows: Sequence[Mapping[str, np.ndarray]]) -> dict[str, Any]:
    """Stack packed rows: ``[batch, seq_len]`` tensors, one flat ``cu_seqlens``, ``max_seqlen``.

    The flat ``cu_seqlens`` indexes the ``[batch * seq_len]`` flattening of the batch, which
    is what varlen attention takes.
    """
    out: dict[str, Any] = {
        key: torch.from_numpy(np.stack([r[key] for r in rows]))
        for key in ("input_ids", "labels", "loss_mask", "position_ids")
    }
    seq_len = out["input_ids"].shape[1]
    parts = [
        np.asarray(r["cu_seqlens"][1:], dtype=np.int64) + i * seq_len for i, r in enumerate(rows)
    ]
    cu = np.concatenate([np.zeros(1, dtype=np.int64), *parts])
    out["cu_seqlens"] = torch.from_numpy(cu.astype(np.int32))
    out["max_seqlen"] = int(np.diff(cu).max())
    return out
