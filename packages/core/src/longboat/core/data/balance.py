"""Data-parallel load balancing: spread a step's work over DP ranks by a cost model.

Samples of multimodal data differ in length by 100x or more, and attention cost grows with
the square of a sequence's length, so the rank that draws the long samples sets the step
time while the others wait at the gradient all-reduce. Before each step the global batch
(what all DP ranks consume together) is re-dealt so every rank gets about the same cost;
the global batch itself does not change, so neither does the step's loss.

A rank's cost is ``quadratic * sum(l**2) + linear * sum(l) + per_item * n`` over the items
``l`` it gets (:class:`CostModel`; :meth:`CostModel.fit` fits the three coefficients to
measured step times). The same model prices a ViT's images by their patch counts.

:func:`balance` is pure and deterministic (ties go to the lower index): greedy
longest-first assignment onto the least-loaded rank that has room (a cap on each rank's
summed size, e.g. its pack length, and / or a fixed item count per rank, e.g. its
microbatches), then a few move / swap refinements between the most and the least loaded
ranks. :func:`round_robin` is the plain sharding it replaces (rank ``r`` takes positions
``r, r + W, ...``), for comparison.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Assignment", "CostModel", "balance", "round_robin"]


@dataclass(frozen=True)
class CostModel:
    """Cost of one rank's items: ``quadratic * sum(l**2) + linear * sum(l) + per_item * n``."""

    quadratic: float = 1.0
    """Weight of the squared lengths (attention)."""
    linear: float = 0.0
    """Weight of the summed lengths (linears, norms, memory traffic)."""
    per_item: float = 0.0
    """Fixed cost per item (kernel launches, per-sample overheads)."""

    def __post_init__(self) -> None:
        for name in ("quadratic", "linear", "per_item"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name}={getattr(self, name)} must be >= 0")

    def item_costs(self, lengths: Sequence[float] | np.ndarray) -> np.ndarray:
        """The cost of each item alone (float64)."""
        n = np.asarray(lengths, dtype=np.float64)
        return self.quadratic * n * n + self.linear * n + self.per_item

    def cost(self, lengths: Sequence[float] | np.ndarray) -> float:
        """The cost of one rank holding ``lengths``."""
        return float(self.item_costs(lengths).sum())

    @classmethod
    def fit(cls, groups: Sequence[Sequence[float]], times: Sequence[float]) -> CostModel:
        """Non-negative least-squares fit of the coefficients to measured times.

        ``groups[k]`` holds the item lengths one rank processed in a step that took
        ``times[k]``. Every subset of the three features is solved and the best fit with no
        negative coefficient wins (three unknowns: exhaustive is exact and cheap).
        """
        if len(groups) != len(times):
            raise ValueError(f"{len(groups)} groups but {len(times)} times")
        if len(groups) < 3:
            raise ValueError("fitting three coefficients needs at least 3 measured steps")
        feats = np.array(
            [
                [sum(float(x) ** 2 for x in g), sum(float(x) for x in g), float(len(g))]
                for g in groups
            ]
        )
        y = np.asarray(times, dtype=np.float64)
        best: tuple[float, np.ndarray] | None = None
        for k in range(1, 4):
            for cols in itertools.combinations(range(3), k):
                sol, *_ = np.linalg.lstsq(feats[:, cols], y, rcond=None)
                if (sol < 0).any():
                    continue
                coef = np.zeros(3)
                coef[list(cols)] = sol
                err = float(((feats @ coef - y) ** 2).sum())
                if best is None or err < best[0] - 1e-12 * max(1.0, err):
                    best = (err, coef)
        if best is None:
            raise ValueError("no non-negative fit: the times do not grow with the work")
        q, lin, per = (float(v) for v in best[1])
        return cls(quadratic=q, linear=lin, per_item=per)


@dataclass(frozen=True)
class Assignment:
    """Item indices per rank (ascending) and each rank's summed cost."""

    ranks: tuple[tuple[int, ...], ...]
    costs: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """Max over mean rank cost (1.0: perfectly even; the step waits for the max)."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean > 0 else 1.0


def _assignment(ranks: Sequence[Sequence[int]], costs: np.ndarray) -> Assignment:
    groups = tuple(tuple(sorted(int(i) for i in r)) for r in ranks)
    return Assignment(groups, tuple(float(costs[list(g)].sum()) if g else 0.0 for g in groups))


def round_robin(costs: Sequence[float] | np.ndarray, num_ranks: int) -> Assignment:
    """Plain sharding: rank ``r`` takes items ``r, r + num_ranks, ...``."""
    c = np.asarray(costs, dtype=np.float64)
    return _assignment([range(r, len(c), num_ranks) for r in range(num_ranks)], c)


def balance(
    costs: Sequence[float] | np.ndarray,
    num_ranks: int,
    *,
    sizes: Sequence[float] | np.ndarray | None = None,
    size_cap: float | None = None,
    per_rank: int | None = None,
    refinements: int = 20,
) -> Assignment:
    """Deal items of ``costs`` to ``num_ranks`` ranks so the most loaded rank costs least.

    ``sizes`` / ``size_cap``: each rank's summed size stays within the cap where any rank
    has room (an item that fits nowhere goes to the rank with the smallest size; the cap is
    the pack length a rank's items must fit in, e.g. 1.2x the mean).
    ``per_rank``: every rank gets exactly this many items (``len(costs)`` must equal
    ``per_rank * num_ranks``), e.g. one packed row per microbatch.
    ``refinements``: at most this many moves / swaps between the most loaded rank and a
    lighter one, each strictly lowering the larger of the two loads.
    """
    c = np.asarray(costs, dtype=np.float64)
    n = len(c)
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1")
    if (c < 0).any():
        raise ValueError("costs must be >= 0")
    s = np.zeros(n) if sizes is None else np.asarray(sizes, dtype=np.float64)
    if len(s) != n:
        raise ValueError(f"{len(s)} sizes for {n} costs")
    if per_rank is not None and per_rank * num_ranks != n:
        raise ValueError(f"per_rank={per_rank} x num_ranks={num_ranks} != {n} items")
    cap = np.inf if size_cap is None else float(size_cap)

    load = np.zeros(num_ranks)
    used = np.zeros(num_ranks)
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(n), key=lambda k: (-c[k], k)):
        open_ = [r for r in range(num_ranks) if per_rank is None or len(ranks[r]) < per_rank]
        fits = [r for r in open_ if used[r] + s[i] <= cap]
        r = (
            min(fits, key=lambda q: (load[q], q))
            if fits
            else min(open_, key=lambda q: (used[q], q))
        )
        ranks[r].append(i)
        load[r] += c[i]
        used[r] += s[i]

    for _ in range(refinements):
        if not _refine_once(ranks, load, used, c, s, cap, fixed_counts=per_rank is not None):
            break
    return _assignment(ranks, c)


def _refine_once(
    ranks: list[list[int]],
    load: np.ndarray,
    used: np.ndarray,
    c: np.ndarray,
    s: np.ndarray,
    cap: float,
    *,
    fixed_counts: bool,
) -> bool:
    """One move or swap out of the most loaded rank that lowers its pair's max; False when
    none exists."""
    hi = int(min(range(len(load)), key=lambda r: (-load[r], r)))
    for lo in sorted(range(len(load)), key=lambda r: (load[r], r)):
        if lo == hi or load[lo] >= load[hi]:
            continue
        best: tuple[float, int, int] | None = None  # (new pair max, item out, item in or -1)
        if not fixed_counts:
            for i in ranks[hi]:
                if used[lo] + s[i] > cap:
                    continue
                peak = max(load[hi] - c[i], load[lo] + c[i])
                if peak < load[hi] and (best is None or peak < best[0]):
                    best = (peak, i, -1)
        for i in ranks[hi]:
            for j in ranks[lo]:
                d = c[i] - c[j]
                if d <= 0 or used[lo] - s[j] + s[i] > cap or used[hi] - s[i] + s[j] > cap:
                    continue
                peak = max(load[hi] - d, load[lo] + d)
                if peak < load[hi] and (best is None or peak < best[0]):
                    best = (peak, i, j)
        if best is None:
            continue
        _, i, j = best
        ranks[hi].remove(i)
        ranks[lo].append(i)
        load[hi] -= c[i]
        load[lo] += c[i]
        used[hi] -= s[i]
        used[lo] += s[i]
        if j >= 0:
            ranks[lo].remove(j)
            ranks[hi].append(j)
            load[lo] -= c[j]
            load[hi] += c[j]
            used[lo] -= s[j]
            used[hi] += s[j]
        return True
    return False
