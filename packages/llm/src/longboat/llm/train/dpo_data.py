"""Preference data of ``llm.objective=dpo``: pairs read from ``data.paths``, as padded rows.

Every path is a raw preference file or folder (JSONL / Parquet / a ``datasets`` folder) of
``chosen`` / ``rejected`` records (``longboat.llm.data.preference``; ``data.columns`` maps
other names), tokenised with the run's tokenizer when the run starts. ``check_preference_inputs``
looks at each path's first record before anything heavy, so a file of chats or text is
refused naming the file and the missing columns.

``PreferenceRows`` holds each pair as two rows of ``data.seq_len`` tokens (input ids, labels
shifted by one, the loss mask on the answer's tokens only, zeros after the end); a
conversation longer than ``seq_len + 1`` tokens is cut at the end (both answers alike keep
the prompt) and a pair whose answer would be cut away entirely is left out.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longboat.core.config.errors import ConfigError

PAIR_KEYS = ("chosen", "rejected")


def check_preference_inputs(data: Any) -> None:
    """Each of ``data.paths`` is a raw input whose first record has ``chosen`` and
    ``rejected`` (after ``data.columns``); ``ConfigError`` naming the file and the missing
    columns otherwise."""
    from longboat.llm.data import sources
    from longboat.llm.data.raw import is_raw_input
    from longboat.llm.data.sft_records import rename_keys

    columns = dict(data.columns)
    for raw in data.paths:
        path = Path(str(raw))
        fix = (
            "point data.paths at preference pairs: records with chosen and rejected (and "
            "prompt), or map your names with data.columns={chosen: good, rejected: bad}"
        )
        if not path.exists() and sources.hub_dataset_id(path) is None:
            raise ConfigError(f"{path} does not exist", key="data.paths", value=str(raw), fix=fix)
        if not is_raw_input(path):
            raise ConfigError(
                f"{path} is a prepared token dataset; DPO reads the preference records themselves",
                key="data.paths",
                value=str(raw),
                fix="point data.paths at the JSONL / Parquet file of pairs",
            )
        try:
            spec = sources.resolve_input(path)
            record = sources.first_record(spec, None)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(str(exc), key="data.paths", value=str(raw), fix=fix) from None
        if not isinstance(record, dict):
            raise ConfigError(
                f"{path}: records are {type(record).__name__}, not objects with chosen / rejected",
                key="data.paths",
                value=str(raw),
                fix=fix,
            )
        missing = [k for k in PAIR_KEYS if k not in rename_keys(record, columns)]
        if missing:
            raise ConfigError(
                f"{path} holds no preference pairs: its records lack the column(s) "
                f"{', '.join(missing)} (they have {', '.join(sorted(record)) or 'none'})",
                key="data.paths",
                value=str(raw),
                fix=fix,
            )


class PreferenceRows:
    """Tokenised pairs as ``[N, 2, seq_len]`` arrays (chosen, rejected); see the module doc."""

    def __init__(self, pairs: list[Any], seq_len: int) -> None:
        kept = []
        self.truncated = 0
        """Pairs with an answer cut at ``seq_len``."""
        for pair in pairs:
            sides = ((pair.chosen_ids, pair.chosen_mask), (pair.rejected_ids, pair.rejected_mask))
            if any(len(ids) > seq_len + 1 for ids, _ in sides):
                self.truncated += 1
            if all(np.asarray(mask[1 : seq_len + 1]).any() for _, mask in sides):
                kept.append(sides)
        self.dropped = len(pairs) - len(kept)
        """Pairs left out: the prompt fills ``seq_len``, so no answer token is left."""
        n = len(kept)
        self.seq_len = seq_len
        self.tokens = np.zeros((n, 2, seq_len), dtype=np.int64)
        self.labels = np.zeros((n, 2, seq_len), dtype=np.int64)
        self.loss_mask = np.zeros((n, 2, seq_len), dtype=np.float32)
        for i, sides in enumerate(kept):
            for j, (ids, mask) in enumerate(sides):
                ids = np.asarray(ids[: seq_len + 1], dtype=np.int64)
                k = len(ids) - 1
                self.tokens[i, j, :k] = ids[:-1]
                self.labels[i, j, :k] = ids[1:]
                self.loss_mask[i, j, :k] = np.asarray(mask[1 : k + 1], dtype=np.float32)

    def __len__(self) -> int:
        return len(self.tokens)

    def max_token(self) -> int:
        """The largest token id of the pairs (-1 with none)."""
        return int(self.tokens.max(initial=-1)) if len(self) else -1

    def microbatch(self, index: Any) -> dict[str, torch.Tensor | None]:
        """Model inputs of the pairs ``index`` (host tensors): ``[2P, seq_len]`` rows, the
        chosen conversations then the rejected ones, and their ``pair_index`` ``[P]``."""
        index = np.asarray(index, dtype=np.int64)

        def both(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.concatenate([a[index, 0], a[index, 1]]))

        tokens = both(self.tokens)
        b, s = tokens.shape
        return {
            "tokens": tokens,
            "labels": both(self.labels),
            "loss_mask": both(self.loss_mask),
            "position_ids": torch.arange(s).unsqueeze(0).expand(b, -1).contiguous(),
            "attention_mask": None,
            "pair_index": torch.from_numpy(index),
        }


def read_preference_data(data: Any, tokenizer_dir: Path, vocab_size: int) -> PreferenceRows:
    """Every pair of ``data.paths``, validated and tokenised (``ConfigError`` naming the file
    and record of a bad one), as rows of ``data.seq_len``."""
    from longboat.llm.data.encoding import load_tokenizer
    from longboat.llm.data.preference import read_preference_pairs

    tok = load_tokenizer(tokenizer_dir)
    pairs: list[Any] = []
    for raw in data.paths:
        try:
            pairs += read_preference_pairs(str(raw), tok, columns=dict(data.columns))
        except ValueError as exc:
            raise ConfigError(
                str(exc),
                key="data.paths",
                value=str(raw),
                fix="fix or drop that record (or map your columns with data.columns)",
            ) from None
    rows = PreferenceRows(pairs, data.seq_len)
    if len(rows) == 0:
        raise ConfigError(
            f"no pair has an answer token within the first {data.seq_len} tokens",
            key="data.seq_len",
            value=data.seq_len,
            fix="raise data.seq_len (up to model.max_position_embeddings)",
        )
    if rows.max_token() >= vocab_size:
        raise ConfigError(
            f"token id {rows.max_token()} of the pairs is outside the model's vocabulary",
            key="model.vocab_size",
            value=vocab_size,
            fix=f"use model.vocab_size>={rows.max_token() + 1} or the checkpoint's tokenizer",
        )
    return rows


def split_pairs(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) pair indices: a seeded permutation's first ``eval_fraction`` is held
    out (sorted)."""
    n_eval = 0 if eval_fraction <= 0 else max(1, math.ceil(n * eval_fraction))
    if n_eval >= n:
        raise ConfigError(
            f"{n} pair(s) cannot be split into train and held-out parts",
            key="data.eval_fraction",
            value=eval_fraction,
            fix="use more pairs or a smaller data.eval_fraction (0: no held-out pairs)",
        )
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


__all__ = [
    "PreferenceRows",
    "check_preference_inputs",
    "read_preference_data",
    "split_pairs",
]
