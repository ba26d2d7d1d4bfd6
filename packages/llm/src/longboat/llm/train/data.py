"""Training data for ``longboat-llm train``: token documents -> packed rows -> microbatches.

Documents come from datasets written by ``longboat-llm data prepare``
(``IndexedTokenDataset``) and are split into train / held-out documents by a seeded
permutation. Rows are packed with core's
``PackedDataset`` (labels never cross documents). Which rows a step reads is a pure function
of the step (core's ``GlobalBatchPlan``, :func:`row_plan`), so resuming at step ``s`` needs no loader state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longboat.core.config.errors import ConfigError
from longboat.core.data.batch_plan import BatchLayout


class Subset(Sequence):
    """Selected documents of another document sequence."""

    def __init__(self, docs: Any, index: np.ndarray) -> None:
        self.docs, self.index = docs, np.asarray(index, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        return self.docs[int(self.index[i])]

    def lengths(self) -> np.ndarray:
        return np.asarray(self.docs.lengths())[self.index]


class Concat(Sequence):
    """Several document sequences back to back."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        part = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[part][i - int(self.starts[part])]

    def lengths(self) -> np.ndarray:
        return np.concatenate([np.asarray(p.lengths()) for p in self.parts])


class SyntheticDocuments(Sequence):
    """``count`` documents of ``length`` uniformly random token ids in ``[0, vocab_size)``,
    document ``i`` drawn from ``(seed, i)`` alone (``data=synthetic``: throughput runs and
    smoke tests that need no corpus)."""

    def __init__(self, count: int, length: int, vocab_size: int, seed: int) -> None:
        self.count, self.length, self.vocab_size, self.seed = count, length, vocab_size, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        if not 0 <= i < self.count:
            raise IndexError(i)
        rng = np.random.default_rng([self.seed, i])
        return rng.integers(0, self.vocab_size, self.length, dtype=np.int64).astype(np.int32)

    def lengths(self) -> np.ndarray:
        return np.full(self.count, self.length, dtype=np.int64)


def open_run_data(data: Any, vocab_size: int, rank: int) -> tuple[list[Any], Path | None]:
    """The document sources of ``cfg.data`` (one per path) and the tokenizer directory.

    ``quickstart`` prepares its corpus on rank 0 first (the other ranks wait), ``prepared``
    opens ``data.paths``, ``synthetic`` draws random tokens (no tokenizer). Every source is
    checked: not empty, token ids inside the model's vocabulary.
    """
    import torch.distributed as dist

    from longboat.llm.train.checks import check_documents

    if data.name == "synthetic":
        docs = SyntheticDocuments(data.num_documents, data.seq_len, vocab_size, data.seed)
        return [docs], None
    if data.name == "quickstart":
        from longboat.llm.quickstart.prepare import prepare_quickstart

        if rank == 0:
            prepare_quickstart(data)
        if dist.is_initialized():
            dist.barrier()
        # Every rank: rank 0's output is up to date now, so this only returns the paths.
        token_dir, tokenizer_dir = prepare_quickstart(data, log=lambda *_: None)
        paths: list[Path] = [token_dir]
    elif data.name == "prepared":
        tokenizer_dir = Path(data.tokenizer)
        paths = [_prepared(Path(p), data, tokenizer_dir, rank) for p in data.paths]
    else:
        raise ConfigError(
            "is not a data kind longboat-llm trains on",
            key="data.name",
            value=data.name,
            fix="use data=quickstart, data=prepared or data=synthetic",
        )
    parts = []
    for p in paths:
        docs = open_documents(p)
        check_documents(docs, "data.paths", str(p), vocab_size)
        parts.append(docs)
    return parts, tokenizer_dir


def _prepared(path: Path, data: Any, tokenizer: Path, rank: int) -> Path:
    """``path`` itself for a prepared dataset; a raw file or folder is prepared into the cache
    first (rank 0 builds, the others wait and reuse it)."""
    import torch.distributed as dist

    from longboat.llm.data.raw import is_raw_input, prepared_path
    from longboat.llm.data.sources import hub_dataset_id

    if not path.exists() and hub_dataset_id(path) is None:
        raise ConfigError(
            f"{path} does not exist",
            key="data.paths",
            value=str(path),
            fix="point at a JSONL / Parquet file or folder, a datasets folder, or a dataset "
            "`longboat-llm data prepare` wrote",
        )
    if not is_raw_input(path):
        return path
    kw = {"cache_dir": data.cache_dir, "format": data.format, "columns": dict(data.columns)}
    error = None
    if rank == 0:
        try:
            prepared_path(path, tokenizer, **kw)
        except (ValueError, FileNotFoundError, FileExistsError) as exc:
            error = exc
    if dist.is_initialized():
        dist.barrier()
    if error is not None:
        raise ConfigError(str(error), key="data.paths", value=str(path)) from None
    return prepared_path(path, tokenizer, **kw, log=lambda *_: None, progress=False)


def train_and_eval_documents(data: Any, parts: list[Any]) -> tuple[Any, Any]:
    """Held-out documents of every source; training documents blended by ``data.weights``."""
    from longboat.core.data.blend import BlendedDataset

    splits = [split_documents(p, data.eval_fraction, data.seed) for p in parts]
    train = [s[0] for s in splits]
    held_out = Concat([s[1] for s in splits])
    weights = getattr(data, "weights", None)
    if len(train) == 1 and weights is None:
        return train[0], held_out
    w = list(weights) if weights is not None else [float(len(t)) for t in train]
    return BlendedDataset(train, w, seed=data.seed), held_out


def open_documents(path: str | Path) -> Any:
    """A dataset written by ``longboat-llm data prepare`` as packing's document sequence.

    SFT datasets give ``{"input_ids", "loss_mask"}`` documents (loss on assistant tokens).
    A missing, unfinished or corrupt dataset raises ``ConfigError`` naming the file.
    """
    from longboat.llm.data import IndexedTokenDataset

    try:
        return IndexedTokenDataset(path).documents()
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(
            str(exc),
            key="data.paths",
            value=str(path),
            fix="run `longboat-llm data prepare` for it (add --force to rebuild)",
        ) from None


def split_documents(docs: Any, eval_fraction: float, seed: int) -> tuple[Any, Any]:
    """(train, held-out) documents: a seeded permutation's first ``eval_fraction`` is held out."""
    n = len(docs)
    n_eval = 0 if eval_fraction <= 0 else max(1, math.ceil(n * eval_fraction))
    if n_eval >= n:
        raise ConfigError(
            f"{n} document(s) cannot be split into train and held-out parts",
            key="data.eval_fraction",
            value=eval_fraction,
            fix="use more data or a smaller eval_fraction",
        )
    order = np.random.default_rng(seed).permutation(n)
    return Subset(docs, np.sort(order[n_eval:])), Subset(docs, np.sort(order[:n_eval]))


def row_plan(num_rows: int, layout: BatchLayout, seed: int, *, shuffle: bool = True) -> Any:
    """Core's ``GlobalBatchPlan`` of the packed rows: epoch ``e`` walks the rows in a numpy
    permutation seeded by ``(seed, e)``; micro-batch ``m`` of DP rank ``r`` is the step's
    ``m x dp + r``-th."""
    from longboat.core.data.batch_plan import GlobalBatchPlan

    return GlobalBatchPlan(
        num_rows, layout, seed=seed, shuffle=shuffle, permutation="numpy", deal="micro_major"
    )


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """megatron attention mask ``[b, 1, s, s]`` (True = blocked) between packed documents.

    A document starts where ``position_ids`` restarts at 0; the causal part is added by the
    attention itself.
    """
    doc = torch.cumsum((position_ids == 0).to(torch.int32), dim=1)
    return (doc.unsqueeze(2) != doc.unsqueeze(1)).unsqueeze(1)


def microbatch(
    rows: list[dict[str, np.ndarray]], device: torch.device, *, document_attention: bool
) -> dict[str, torch.Tensor]:
    """Model inputs of one microbatch from packed rows."""
    tokens = torch.from_numpy(np.stack([r["input_ids"] for r in rows]))
    labels = torch.from_numpy(np.stack([r["labels"] for r in rows]))
    loss_mask = torch.from_numpy(np.stack([r["loss_mask"] for r in rows])).float()
    position_ids = torch.from_numpy(np.stack([r["position_ids"] for r in rows]))
    batch = {
        "tokens": tokens,
        "labels": labels.clamp(min=0),  # ignored positions carry loss_mask 0
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "attention_mask": document_mask(position_ids) if document_attention else None,
    }
    return {k: (v.to(device) if v is not None else None) for k, v in batch.items()}
