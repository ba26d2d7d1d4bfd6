"""Tokenising one chunk of records (runs in ``data prepare``'s worker processes).

Pretraining: ``tokenizer(text)`` (its own BOS handling) plus EOS. SFT: the conversation is
rendered with the tokenizer's chat template and the loss mask covers exactly the characters
each assistant turn adds: the render of ``messages[: i + 1]`` minus the render of
``messages[:i]`` with the generation prompt. Working on characters (then tokens through the
offset mapping) makes this robust to templates and to BPE merges across turn boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from longboat.core.data.chat import assistant_masked_ids

__all__ = ["ChunkResult", "encode_pretrain", "encode_sft", "load_tokenizer", "render_sft"]

Overflow = Literal["truncate", "drop"]
_TOKENIZER: Any = None


@dataclass
class ChunkResult:
    """Tokens of the kept documents of a chunk, their lengths, masks (SFT) and counters."""

    tokens: np.ndarray
    lengths: np.ndarray
    mask: np.ndarray | None
    stats: dict[str, int] = field(default_factory=dict)


def load_tokenizer(path: str | Path) -> Any:
    """A ``transformers`` tokenizer from a local directory (never the hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def init_worker(tokenizer_dir: str) -> None:
    """Pool initializer: load the tokenizer once per worker process."""
    global _TOKENIZER
    _TOKENIZER = load_tokenizer(tokenizer_dir)


def _concat(docs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)


def encode_pretrain(
    texts: list[Any], append_eos: bool, tokenizer: Any = None, first_index: int = 0
) -> ChunkResult:
    """Token ids of each text (+ EOS); null and empty texts are skipped and counted
    (``skipped_null``, ``skipped_empty``)."""
    tok = tokenizer if tokenizer is not None else _TOKENIZER
    docs: list[np.ndarray] = []
    empty = null = 0
    for i, text in enumerate(texts):
        if text is None:  # a JSON null or a null cell: nothing to train on
            null += 1
            continue
        if not isinstance(text, str):
            raise ValueError(
                f"record {first_index + i}: text is {type(text).__name__}, not a string; "
                "check --text-key"
            )
        ids = tok(text)["input_ids"] if text else []
        if not ids:
            empty += 1
            continue
        if append_eos and tok.eos_token_id is not None and ids[-1] != tok.eos_token_id:
            ids = [*ids, tok.eos_token_id]
        docs.append(np.asarray(ids, dtype=np.int64))
    stats = {"records": len(texts), "docs": len(docs), "skipped_null": null}
    stats["skipped_empty"] = empty
    return ChunkResult(_concat(docs), np.asarray([len(d) for d in docs], np.int64), None, stats)


def render_sft(tok: Any, messages: Any, index: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a chat record and its loss mask (1 on assistant-turn tokens)."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise ValueError(
            f"record {index}: 'messages' must be a list of {{'role', 'content'}} dicts, "
            f"got {str(messages)[:80]!r}"
        )
    return assistant_masked_ids(tok, messages, at=f"record {index}")


def encode_sft(
    records: list[Any],
    max_len: int | None,
    overflow: Overflow,
    tokenizer: Any = None,
    first_index: int = 0,
) -> ChunkResult:
    """Render, mask and length-limit each chat record (counters in ``stats``)."""
    tok = tokenizer if tokenizer is not None else _TOKENIZER
    docs, masks = [], []
    stats = {"records": len(records), "docs": 0, "truncated": 0, "dropped_overflow": 0}
    stats["dropped_no_assistant"] = 0
    for i, messages in enumerate(records):
        ids, mask = render_sft(tok, messages, first_index + i)
        if max_len is not None and len(ids) > max_len:
            if overflow == "drop":
                stats["dropped_overflow"] += 1
                continue
            ids, mask = ids[:max_len], mask[:max_len]
            stats["truncated"] += 1
        if not mask.any():
            stats["dropped_no_assistant"] += 1
            continue
        docs.append(ids)
        masks.append(mask)
    stats["docs"] = len(docs)
    lengths = np.asarray([len(d) for d in docs], np.int64)
    mask_all = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
    return ChunkResult(_concat(docs), lengths, mask_all, stats)


def encode_chunk(job: tuple[Any, ...]) -> ChunkResult:
    """Pool entry point: ``(kind, first_index, records, options)``."""
    kind, first_index, records, opts = job
    if kind == "sft":
        return encode_sft(records, opts["max_seq_len"], opts["overflow"], first_index=first_index)
    return encode_pretrain(records, opts["append_eos"], first_index=first_index)
