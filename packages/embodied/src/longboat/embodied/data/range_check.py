"""Values far outside a dataset's own ``meta/stats.json`` range: the mark of a corrupt file.

A few flipped bytes in a parquet page can leave the file readable with a state of -1.2e29;
min-max normalisation would clip it to -1 and train on it silently. The check runs once over
the loaded columns (vectorised numpy, no per-sample cost): a value is bad when it is not
finite or lies more than ``factor`` times the feature's range beyond its min or max.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

FAR_OUTSIDE_FACTOR = 10.0
"""A value more than this many ranges (max - min) beyond min or max is bad."""
_BLOCK_ROWS = 1 << 18


@dataclass(frozen=True)
class RangeViolation:
    """The first bad value of one feature (``row`` indexes the loaded columns)."""

    key: str
    row: int
    dim: int
    value: float
    low: float
    high: float
    """The stats' min and max of that dimension."""
    rows: int
    """Rows of this feature with at least one bad value."""


def _bounds(stats: Mapping[str, np.ndarray], dims: int) -> tuple[np.ndarray, np.ndarray] | None:
    lo, hi = stats.get("min"), stats.get("max")
    if lo is None or hi is None:
        return None
    lo, hi = np.asarray(lo, np.float64).reshape(-1), np.asarray(hi, np.float64).reshape(-1)
    if lo.shape != (dims,) or hi.shape != (dims,):
        return None  # stats of another shape (an image, a stale file): nothing to check against
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        return None
    return lo, hi


def far_outside_stats(
    columns: Mapping[str, np.ndarray],
    stats: Mapping[str, Mapping[str, np.ndarray]],
    keys: Sequence[str],
    factor: float = FAR_OUTSIDE_FACTOR,
) -> tuple[np.ndarray, list[RangeViolation]]:
    """Rows of ``columns`` holding a bad value in any float feature of ``keys`` that has
    min/max stats, as a bool mask [N], and the first bad value of each such feature."""
    n = len(next(iter(columns.values()))) if columns else 0
    bad_rows = np.zeros(n, dtype=bool)
    found: list[RangeViolation] = []
    if n == 0:
        return bad_rows, found
    for key in keys:
        col = columns.get(key)
        if col is None or key not in stats or not np.issubdtype(col.dtype, np.floating):
            continue
        values = col.reshape(n, -1)
        bounds = _bounds(stats[key], values.shape[1])
        if bounds is None:
            continue
        lo, hi = bounds
        # A constant feature has range 0: allow its own magnitude (at least 1) instead.
        span = np.where(hi > lo, hi - lo, np.maximum(np.maximum(np.abs(lo), np.abs(hi)), 1.0))
        low, high = lo - factor * span, hi + factor * span
        rows = np.zeros(n, dtype=bool)
        for begin in range(0, n, _BLOCK_ROWS):  # bounded temporaries on large datasets
            block = values[begin : begin + _BLOCK_ROWS]
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(block) | (block < low) | (block > high)
            rows[begin : begin + len(block)] = bad.any(axis=1)
        if not rows.any():
            continue
        bad_rows |= rows
        row = int(np.flatnonzero(rows)[0])
        value = values[row].astype(np.float64)
        dim = int(np.flatnonzero(~np.isfinite(value) | (value < low) | (value > high))[0])
        found.append(
            RangeViolation(
                key, row, dim, float(value[dim]), float(lo[dim]), float(hi[dim]), int(rows.sum())
            )
        )
    return bad_rows, found


__all__ = ["FAR_OUTSIDE_FACTOR", "RangeViolation", "far_outside_stats"]
