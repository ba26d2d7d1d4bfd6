"""The chat forms SFT records come in, read as one list of ``{"role", "content"}`` turns.

Accepted, in this order of precedence (the first whose keys a record has):

- ``messages``: ``[{"role": "user", "content": ...}, {"role": "assistant", ...}]``;
- ``conversations`` (ShareGPT): ``[{"from": "human", "value": ...}, {"from": "gpt", ...}]``;
- ``instruction`` / ``input`` / ``output`` (Alpaca): the user turn is the instruction, and
  the input after a blank line when there is one; the assistant turn the output;
- ``prompt`` / ``completion``: strings (one user and one assistant turn) or lists of turns.

Any form may have a ``system`` string, put first as a system turn. Turns may name their
speaker ``role`` or ``from`` and their text ``content`` or ``value``; ``human`` and ``gpt``
(ShareGPT) are read as ``user`` and ``assistant``. Records whose keys have other names are
read through a key mapping (``data.columns`` / ``--columns``): ``{canonical: yours}``, e.g.
``{"prompt": "question", "completion": "answer"}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["CANONICAL_KEYS", "chat_form", "parse_columns", "rename_keys", "to_messages"]

CANONICAL_KEYS = (
    "messages",
    "conversations",
    "instruction",
    "input",
    "output",
    "prompt",
    "completion",
    "system",
    "text",
)
"""The record keys longboat reads; ``data.columns`` maps other names onto them."""

_ROLES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
    "tool": "tool",
}


def parse_columns(spec: str | Mapping[str, str] | None) -> dict[str, str]:
    """A key mapping from ``"prompt=question,completion=answer"`` or a mapping; checks that
    every canonical key is one longboat reads."""
    if not spec:
        return {}
    if isinstance(spec, str):
        pairs = [p.split("=", 1) for p in spec.split(",") if p.strip()]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(
                f"columns {spec!r}: write canonical=yours pairs separated by commas, e.g. "
                "prompt=question,completion=answer"
            )
        spec = {a.strip(): b.strip() for a, b in pairs}
    unknown = sorted(set(spec) - set(CANONICAL_KEYS))
    if unknown:
        raise ValueError(
            f"columns: {unknown} are not keys longboat reads; map your names onto "
            f"{list(CANONICAL_KEYS)} (canonical=yours)"
        )
    return {str(k): str(v) for k, v in spec.items()}


def rename_keys(record: Mapping[str, Any], columns: Mapping[str, str]) -> dict[str, Any]:
    """``record`` with the mapped keys under their canonical names."""
    out = dict(record)
    for canonical, yours in columns.items():
        if yours in record:
            out[canonical] = record[yours]
    return out


def chat_form(record: Any) -> str | None:
    """Which chat form ``record`` (keys already canonical) is in, or None."""
    if not isinstance(record, Mapping):
        return None
    if isinstance(record.get("messages"), list):
        return "messages"
    if isinstance(record.get("conversations"), list):
        return "conversations"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    return None


def _turns(turns: Any, at: str, key: str) -> list[dict[str, str]]:
    if not isinstance(turns, list):
        raise ValueError(f"{at}: {key!r} must be a list of turns, got {str(turns)[:80]!r}")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise ValueError(f"{at}: {key}[{i}] is not a turn object: {str(turn)[:80]!r}")
        speaker = turn.get("role", turn.get("from"))
        text = turn.get("content", turn.get("value"))
        role = _ROLES.get(str(speaker).lower()) if speaker is not None else None
        if role is None or not isinstance(text, str):
            raise ValueError(
                f"{at}: {key}[{i}] must have a role (user / assistant / system, or ShareGPT's "
                f"human / gpt under 'from') and a string content (or 'value'); got "
                f"{str(dict(turn))[:80]!r}"
            )
        out.append({"role": role, "content": text})
    return out


def _text(value: Any, at: str, key: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{at}: {key!r} must be a string, got {type(value).__name__}")
    return value


def to_messages(
    record: Any, at: str, columns: Mapping[str, str] | None = None
) -> list[dict[str, str]]:
    """The turns of one SFT record in any accepted form (see the module doc); ``ValueError``
    naming ``at`` (file and line or row) when it is in none."""
    if isinstance(record, list):  # a bare list of turns (a messages column read alone)
        return _turns(record, at, "messages")
    if not isinstance(record, Mapping):
        raise ValueError(f"{at}: a record must be an object, got {type(record).__name__}")
    rec = rename_keys(record, columns or {})
    form = chat_form(rec)
    if form is None:
        mapped = (columns or {}).get("messages", "messages")
        raise ValueError(
            f"{at}: record has no key {mapped!r} nor another chat form (keys: "
            f"{sorted(record)}); SFT records hold 'messages', 'conversations' (ShareGPT), "
            "'instruction' / 'output' (Alpaca) or 'prompt' / 'completion'; map other names "
            "with data.columns (--columns), e.g. prompt=question,completion=answer"
        )
    if form in ("messages", "conversations"):
        turns = _turns(rec[form], at, form)
    elif form == "alpaca":
        user = _text(rec["instruction"], at, "instruction")
        extra = rec.get("input")
        if extra:
            user = f"{user}\n\n{_text(extra, at, 'input')}"
        turns = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": _text(rec["output"], at, "output")},
        ]
    else:
        prompt, completion = rec["prompt"], rec["completion"]
        turns = (
            _turns(prompt, at, "prompt")
            if isinstance(prompt, list)
            else [{"role": "user", "content": _text(prompt, at, "prompt")}]
        )
        turns += (
            _turns(completion, at, "completion")
            if isinstance(completion, list)
            else [{"role": "assistant", "content": _text(completion, at, "completion")}]
        )
    system = rec.get("system")
    if system and not (turns and turns[0]["role"] == "system"):
        turns.insert(0, {"role": "system", "content": _text(system, at, "system")})
    return turns
