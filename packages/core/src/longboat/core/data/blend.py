"""Weighted blends of datasets with a deterministic, resumable sample order.

Which source each global sample comes from is fixed by the weights alone: the ``k``-th
sample of source ``d`` is due at time ``(k + 0.5) / w_d`` and samples are served in order of
due time (ties by source index). Every prefix of ``n`` samples then holds within one sample
of ``w_d * n`` from each source, so proportions are exact over any window up to +-2.

Which sample of a source is served is drawn from ``seed``: source ``d`` is walked in a
permutation seeded by ``(seed, d, epoch)`` that is redrawn each time the source is exhausted
(``shuffle=False`` walks it in order). Everything is a pure function of the global index, so
the blend is map-style (any sampler works) and its own iterator resumes exactly from
``state_dict()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["BlendedDataset", "blend_schedule"]


def _normalise(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(
            f"blend weights {list(weights)} must be finite, >= 0, at least one > 0 "
            "(one per dataset)"
        )
    return w / w.sum()


def blend_schedule(weights: Sequence[float], num_samples: int) -> np.ndarray:
    """Source index of each of ``num_samples`` global samples (int32), by due time."""
    w = _normalise(weights)
    due_parts, src_parts = [], []
    for d, wd in enumerate(w):
        if wd == 0:
            continue
        count = int(np.ceil(wd * num_samples)) + 1
        due_parts.append((np.arange(count) + 0.5) / wd)
        src_parts.append(np.full(count, d, dtype=np.int32))
    due, src = np.concatenate(due_parts), np.concatenate(src_parts)
    order = np.lexsort((src, due))[:num_samples]
    return src[order]


class BlendedDataset(torch.utils.data.Dataset):
    """``num_samples`` samples drawn from ``datasets`` in proportion to ``weights``.

    Args:
        datasets: map-style datasets (``len`` and ``[i]``); each must be non-empty.
        weights: one weight per dataset (normalised; zeros allowed).
        num_samples: length of the blend (default: the total size of the datasets).
        seed: seed of the per-source sample order.
        shuffle: walk each source in a seeded permutation (else in order).
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float],
        *,
        num_samples: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(
                f"BlendedDataset got {len(datasets)} datasets but {len(weights)} weights; "
                "give one weight per dataset"
            )
        self.sizes = [len(d) for d in datasets]
        for i, n in enumerate(self.sizes):
            if n == 0:
                raise ValueError(f"BlendedDataset: dataset {i} is empty; drop it from the blend")
        self.datasets = list(datasets)
        self.weights = _normalise(weights)
        self.num_samples = sum(self.sizes) if num_samples is None else int(num_samples)
        if self.num_samples < 1:
            raise ValueError(f"num_samples={self.num_samples} must be >= 1")
        self.seed = seed
        self.shuffle = shuffle
        self.source = blend_schedule(self.weights, self.num_samples)
        # Rank of each sample among its source's samples: the k of "k-th sample of d".
        self.rank = np.zeros(self.num_samples, dtype=np.int64)
        for d in range(len(self.datasets)):
            where = np.flatnonzero(self.source == d)
            self.rank[where] = np.arange(len(where))
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self._position = 0

    def __len__(self) -> int:
        return self.num_samples

    def _perm(self, d: int, epoch: int) -> np.ndarray:
        key = (d, epoch)
        perm = self._perms.get(key)
        if perm is None:
            perm = np.random.default_rng([self.seed, d, epoch]).permutation(self.sizes[d])
            # Keep a few: consecutive indices mostly hit the same (source, epoch) pairs.
            self._perms = {key: perm, **dict(list(self._perms.items())[:7])}
        return perm

    def locate_many(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`locate`: ``(datasets, sample indices)`` of global ``indices``."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_samples):
            raise IndexError(f"blend indices outside [0, {self.num_samples})")
        src = self.source[indices].astype(np.int64)
        sizes = np.asarray(self.sizes, dtype=np.int64)[src]
        epoch, local = np.divmod(self.rank[indices], sizes)
        if self.shuffle:
            for d, e in set(zip(src.tolist(), epoch.tolist(), strict=True)):
                sel = (src == d) & (epoch == e)
                local[sel] = self._perm(d, e)[local[sel]]
        return src, local

    def locate(self, index: int) -> tuple[int, int]:
        """``(dataset, sample index in it)`` of global sample ``index``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"blend index {index} outside [0, {self.num_samples})")
        d = int(self.source[index])
        epoch, k = divmod(int(self.rank[index]), self.sizes[d])
        return d, int(self._perm(d, epoch)[k]) if self.shuffle else k

    def __getitem__(self, index: int) -> Any:
        d, i = self.locate(index)
        return self.datasets[d][i]

    def lengths(self) -> np.ndarray:
        """Token count per sample when every source has ``lengths()`` (for packing plans)."""
        src, local = self.locate_many(np.arange(self.num_samples))
        out = np.zeros(self.num_samples, dtype=np.int64)
        for d, ds in enumerate(self.datasets):
            sel = src == d
            out[sel] = np.asarray(ds.lengths())[local[sel]]
        return out

    def __iter__(self) -> Iterator[Any]:
        """Samples from the saved position to the end; the next pass starts from 0."""
        while self._position < self.num_samples:
            item = self[self._position]
            self._position += 1
            yield item
        self._position = 0

    def state_dict(self) -> dict[str, Any]:
        """Iterator position plus what the order depends on (checked on load)."""
        return {
            "position": self._position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "weights": self.weights.tolist(),
            "sizes": list(self.sizes),
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position; the blend must be built the same way."""
        mine = self.state_dict()
        for key in ("seed", "shuffle", "sizes", "num_samples"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"blend state has {key}={state[key]!r}, this blend has {key}={mine[key]!r}: "
                    "resume with the same datasets, weights, seed and num_samples"
                )
        if not np.allclose(state["weights"], mine["weights"], rtol=0, atol=1e-12):
            raise ValueError(
                f"blend state has weights={state['weights']}, this blend has "
                f"{mine['weights']}: resume with the same weights"
            )
        self._position = int(state["position"])
