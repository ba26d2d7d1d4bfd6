"""Chat records -> token ids and an assistant-only loss mask, through a tokenizer's template.

The conversation is rendered once with the tokenizer's chat template; each assistant turn's
span is located by rendering the turns before it (with the generation prompt) and through
it, which only works for templates that render every turn as a prefix of the whole
conversation (Llama 3, Qwen, ...). Tokens whose first character falls in an assistant span
get mask 1: the turn's content, its end-of-turn token and what the template puts after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], generation_prompt: bool) -> str:
    """The chat template's text of ``messages`` ("" for none)."""
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def assistant_masked_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    at: str,
    error: type[Exception] = ValueError,
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int64, mask uint8)`` of ``messages``; ``error`` (naming ``at``) when the template
    rewrites earlier turns, so assistant spans cannot be located."""
    full = render_chat(tokenizer, messages, False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], True)
        through = render_chat(tokenizer, messages[: i + 1], False)
        if not (full.startswith(through) and through.startswith(before)):
            raise error(
                f"{at}: the chat template does not render turn {i} as a prefix of the "
                "conversation (it rewrites earlier turns), so assistant tokens cannot be "
                "located; split the conversation or use a prefix-stable template"
            )
        spans.append((len(before), len(through)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return ids, mask
