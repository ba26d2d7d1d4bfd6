"""Preference pairs (``chosen`` / ``rejected``), read, validated and tokenised for a
DPO-style objective.

A record holds one prompt and two answers to it, in either of the forms preference sets
come in:

- explicit prompt: ``{"prompt": ..., "chosen": ..., "rejected": ...}``, each a string (a
  user turn; the answers assistant turns) or a list of ``{"role", "content"}`` turns;
- implicit prompt: ``{"chosen": [turns], "rejected": [turns]}``, two whole conversations
  that share every turn but their last assistant turn.

``data.columns``-style key mapping (``{"chosen": "good"}``) reads other names. Each pair is
rendered with the tokenizer's chat template; ``chosen_ids`` / ``rejected_ids`` are the whole
conversations, their masks 1 on the answer's tokens, and both start with the same prompt
tokens (``prompt_len``). A record that is not a valid pair is named with its file and line:
no prompt, an empty or missing answer, two identical answers, answers that are not
assistant turns, or conversations that differ before their last turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from longboat.llm.data import sources
from longboat.llm.data.sft_records import rename_keys

__all__ = ["PreferencePair", "preference_turns", "read_preference_pairs"]


@dataclass(frozen=True)
class PreferencePair:
    """One tokenised pair: the same prompt, a chosen and a rejected answer."""

    chosen_ids: np.ndarray
    chosen_mask: np.ndarray
    """1 on the chosen answer's tokens (the loss / log-probability span)."""
    rejected_ids: np.ndarray
    rejected_mask: np.ndarray
    prompt_len: int
    """Tokens both conversations start with (the prompt)."""
    where: str
    """File and line of the record."""


def _turns(value: Any, role: str, at: str, key: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(
        isinstance(t, Mapping) and isinstance(t.get("role"), str)
        and isinstance(t.get("content"), str) for t in value
    ):  # fmt: skip
        return [{"role": t["role"], "content": t["content"]} for t in value]
    raise ValueError(
        f"{at}: {key!r} must be a string or a list of {{'role', 'content'}} turns, got "
        f"{str(value)[:80]!r}"
    )


def preference_turns(
    record: Any, at: str, columns: Mapping[str, str] | None = None
) -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]:
    """``(prompt turns, chosen answer turns, rejected answer turns)`` of one record, validated
    (see the module doc); ``ValueError`` naming ``at``."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{at}: a record must be an object, got {type(record).__name__}")
    rec = rename_keys(record, columns or {})
    missing = [k for k in ("chosen", "rejected") if k not in rec]
    if missing:
        raise ValueError(
            f"{at}: a preference pair needs 'chosen' and 'rejected' (missing {missing}; keys: "
            f"{sorted(record)}); map other names with columns, e.g. chosen=good,rejected=bad"
        )
    if "prompt" in rec:
        prompt = _turns(rec["prompt"], "user", at, "prompt")
        chosen = _turns(rec["chosen"], "assistant", at, "chosen")
        rejected = _turns(rec["rejected"], "assistant", at, "rejected")
    else:
        whole_c = _turns(rec["chosen"], "assistant", at, "chosen")
        whole_r = _turns(rec["rejected"], "assistant", at, "rejected")
        if len(whole_c) < 2 or len(whole_r) < 2 or whole_c[:-1] != whole_r[:-1]:
            raise ValueError(
                f"{at}: without a 'prompt', 'chosen' and 'rejected' must be conversations "
                "that share every turn but the last (the prompt); give a 'prompt' key instead"
            )
        prompt, chosen, rejected = whole_c[:-1], whole_c[-1:], whole_r[-1:]
    if not prompt or not any(t["content"].strip() for t in prompt):
        raise ValueError(f"{at}: the prompt is empty")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer or any(t["role"] != "assistant" for t in answer):
            raise ValueError(f"{at}: {name!r} must be assistant turns (the answer)")
        if not any(t["content"].strip() for t in answer):
            raise ValueError(f"{at}: the {name} answer is empty")
    if chosen == rejected:
        raise ValueError(f"{at}: 'chosen' and 'rejected' are the same answer: nothing to prefer")
    return prompt, chosen, rejected


def _encode(tok: Any, prompt: list, answer: list, at: str) -> tuple[np.ndarray, np.ndarray]:
    from longboat.core.data.chat import assistant_masked_ids

    return assistant_masked_ids(tok, [*prompt, *answer], at=at)


def read_preference_pairs(
    path: str | Path, tokenizer: Any, *, columns: Mapping[str, str] | None = None
) -> list[PreferencePair]:
    """Every pair of ``path`` (JSONL / Parquet / a folder / a ``datasets`` folder),
    validated and tokenised with ``tokenizer``'s chat template (see the module doc)."""
    spec = sources.resolve_input(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; preference pairs are chats")
    pairs: list[PreferencePair] = []

    def convert(record: Any, at: str) -> PreferencePair:
        prompt, chosen, rejected = preference_turns(record, at, columns)
        c_ids, c_mask = _encode(tokenizer, prompt, chosen, at)
        r_ids, r_mask = _encode(tokenizer, prompt, rejected, at)
        first_c = int(np.argmax(c_mask)) if c_mask.any() else len(c_ids)
        first_r = int(np.argmax(r_mask)) if r_mask.any() else len(r_ids)
        if first_c != first_r or not np.array_equal(c_ids[:first_c], r_ids[:first_r]):
            raise ValueError(
                f"{at}: the chat template renders the prompt differently before the two "
                "answers, so their log-probabilities cannot be compared"
            )
        return PreferencePair(c_ids, c_mask, r_ids, r_mask, first_c, at)

    for chunk in sources.iter_record_chunks(spec, None, 256, convert):
        pairs.extend(chunk)
    if not pairs:
        raise ValueError(f"{path} holds no preference pairs")
    return pairs
