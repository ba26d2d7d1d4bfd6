"""Did-you-mean suggestions for misspelled keys and names."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


def close_matches(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` candidates that look like ``name``, best first.

    difflib ratio >= 0.6, and within 0.1 of the best one so a clear winner
    (``trian`` -> ``train``) is not diluted by weak look-alikes (``extra``).
    """
    scored = []
    for cand in candidates:
        matcher = difflib.SequenceMatcher(None, name, cand)
        if matcher.real_quick_ratio() >= 0.6 and matcher.quick_ratio() >= 0.6:
            ratio = matcher.ratio()
            if ratio >= 0.6:
                scored.append((ratio, cand))
    if not scored:
        return []
    scored.sort(key=lambda rc: (-rc[0], rc[1]))
    best = scored[0][0]
    return [cand for ratio, cand in scored[:n] if ratio >= best - 0.1]


def did_you_mean(
    name: str, candidates: Sequence[str], *, what: str = "valid values", limit: int = 12
) -> str:
    """A fix hint: ``did you mean 'x'?`` plus the list of what is valid."""
    options = sorted(candidates)
    shown = ", ".join(options[:limit]) + (", ..." if len(options) > limit else "")
    listing = f"{what}: {shown}" if options else f"there are no {what}"
    matches = close_matches(name, options)
    if matches:
        guesses = " or ".join(repr(m) for m in matches)
        return f"did you mean {guesses}? ({listing})"
    return f"use one of the {listing}" if options else listing
