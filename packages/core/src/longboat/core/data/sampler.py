"""A resumable, deterministic distributed sampler.

The order of epoch ``e`` is a permutation drawn from ``seed + e`` only, so every
rank (and every restart) computes the same global order without talking to the
others. Rank ``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...`` of it.

The saved position is *global* (samples consumed by all ranks together), so a
run saved at one world size resumes at another and continues with the next
unseen samples.

The position counts the indices this sampler has handed out. With a
``DataLoader`` using ``num_workers=0`` that is exactly what the loop consumed;
worker processes prefetch indices ahead of the loop, so save the position from
a loader that does not prefetch, or accept that prefetched samples are skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch.distributed as dist
from torch.utils.data import Sampler

from longboat.core.data.batch_plan import epoch_permutation

__all__ = ["StatefulDistributedSampler"]


def _default_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class StatefulDistributedSampler(Sampler[int]):
    """Shuffled (or sequential) per-epoch order, sharded by rank, resumable mid-epoch.

    Args:
        dataset: anything with ``len()`` (or the length itself).
        num_replicas: data-parallel world size (default: the process group's size, else 1).
        rank: data-parallel rank (default: the process group's rank, else 0).
        shuffle: draw a fresh permutation each epoch.
        seed: base seed of the order; epoch ``e`` uses ``seed + e``.
        drop_last: drop the tail that does not divide evenly across ranks
            (otherwise pad it by repeating samples from the start of the order).
    """

    def __init__(
        self,
        dataset: Sized | int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.num_samples_total = dataset if isinstance(dataset, int) else len(dataset)
        default_rank, default_world = _default_world()
        self.num_replicas = default_world if num_replicas is None else num_replicas
        self.rank = default_rank if rank is None else rank
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas={self.num_replicas} must be >= 1")
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"rank={self.rank} is outside [0, num_replicas={self.num_replicas}); "
                "pass the data-parallel rank and size"
            )
        if self.num_samples_total < 1:
            raise ValueError("the dataset is empty; the sampler needs at least one sample")
        if drop_last and self.num_samples_total < self.num_replicas:
            raise ValueError(
                f"drop_last=True with {self.num_samples_total} samples and "
                f"{self.num_replicas} ranks leaves nothing to sample; use drop_last=False"
            )
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._start = 0  # global position where the next __iter__ begins
        self._yielded = 0  # indices handed out by the current iterator (this rank)

    # --- order -----------------------------------------------------------------------

    def _epoch_total(self) -> int:
        n, w = self.num_samples_total, self.num_replicas
        return (n // w) * w if self.drop_last else -(-n // w) * w

    def _global_order(self) -> list[int]:
        n = self.num_samples_total
        if self.shuffle:
            order = epoch_permutation(n, self.seed, self.epoch, "torch").tolist()
        else:
            order = list(range(n))
        total = self._epoch_total()
        while len(order) < total:  # pad by wrapping around (may need several laps)
            order += order[: total - len(order)]
        return order[:total]

    def _remaining(self) -> list[int]:
        order = self._global_order()
        rest = order[self._start :]
        # After resuming at another world size the rest may not divide evenly;
        # every rank must yield the same count or collectives deadlock.
        extra = len(rest) % self.num_replicas
        if extra:
            if self.drop_last:
                rest = rest[: len(rest) - extra]
            else:
                rest = rest + order[: self.num_replicas - extra]
        return rest

    @property
    def position(self) -> int:
        """Global samples consumed so far in the current epoch (all ranks)."""
        return self._start + self._yielded * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        # Starting a new pass after a finished one moves to the next epoch, so a
        # loop that never calls set_epoch still gets fresh orders.
        self._start = self.position
        self._yielded = 0
        if self._start >= self._epoch_total():
            self.epoch += 1
            self._start = 0
        mine = self._remaining()[self.rank :: self.num_replicas]
        return self._generate(mine)

    def _generate(self, mine: list[int]) -> Iterator[int]:
        for index in mine:
            self._yielded += 1
            yield index

    def __len__(self) -> int:
        """Indices this rank yields in the next pass."""
        start = self.position
        if start >= self._epoch_total():
            start = 0
        saved = self._start, self._yielded
        self._start, self._yielded = start, 0
        try:
            return len(self._remaining()) // self.num_replicas
        finally:
            self._start, self._yielded = saved

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its start; the current epoch keeps its position (resume)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._start = 0
            self._yielded = 0

    # --- state -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Epoch and global position, plus what the order depends on (for validation)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples_total,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved epoch and position (any world size)."""
        for key, mine in (
            ("num_samples", self.num_samples_total),
            ("seed", self.seed),
            ("shuffle", self.shuffle),
        ):
            if state_dict[key] != mine:
                raise ValueError(
                    f"sampler state has {key}={state_dict[key]!r} but this sampler has "
                    f"{key}={mine!r}; the saved position only makes sense for the same data "
                    "order: restore the original dataset/seed or resume without the sampler state"
                )
        self.epoch = int(state_dict["epoch"])
        self._start = int(state_dict["position"])
        self._yielded = 0
