"""Episode-aware, shuffled, DP-sharded sampler whose position can be saved and restored exactly."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch


class EpisodeAwareSampler(torch.utils.data.Sampler[int]):
    """Yields dataset positions of the frames of the given episodes, shuffled per epoch.

    ``episode_ranges`` are [start, end) positions per episode (``LeRobotDataset.episode_ranges``).
    ``drop_n_first_frames`` / ``drop_n_last_frames`` leave out frames near episode bounds (e.g.
    frames whose action chunk would be mostly padding). Each epoch permutes the eligible
    positions with a generator seeded by ``(seed, epoch)``, pads them to a multiple of
    ``world_size`` by wrapping around (or truncates with ``drop_last``) and gives rank ``r``
    positions ``r, r + world_size, ...``, so all ranks see disjoint shards of equal length.
    After a full pass the epoch advances by itself.

    ``state_dict()`` records (epoch, position in this rank's shard); ``load_state_dict`` makes
    the next ``__iter__`` continue exactly there. A DataLoader pulls indices ahead of the
    training step (workers x prefetch); pass ``consumed=`` (samples the step really used this
    epoch, counted from where this iteration started) to save the true position.
    """

    def __init__(
        self,
        episode_ranges: Sequence[tuple[int, int]],
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_n_first_frames: int = 0,
        drop_n_last_frames: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if drop_n_first_frames < 0 or drop_n_last_frames < 0:
            raise ValueError("drop_n_first_frames and drop_n_last_frames must be >= 0")
        indices: list[int] = []
        for start, end in episode_ranges:
            indices.extend(range(start + drop_n_first_frames, end - drop_n_last_frames))
        if not indices:
            raise ValueError(
                "no frames left to sample: every episode is shorter than "
                f"drop_n_first_frames + drop_n_last_frames = "
                f"{drop_n_first_frames + drop_n_last_frames}"
            )
        self.indices = torch.tensor(indices, dtype=torch.int64)
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # samples of this rank's shard already yielded this epoch
        self._iter_start = 0

    def __len__(self) -> int:
        n = len(self.indices)
        return n // self.world_size if self.drop_last else -(-n // self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (like ``DistributedSampler.set_epoch``)."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def shard(self, epoch: int) -> torch.Tensor:
        """This rank's positions for ``epoch`` in order."""
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = self.indices[torch.randperm(len(self.indices), generator=gen)]
        else:
            order = self.indices
        total = len(self) * self.world_size
        if total > len(order):
            reps = -(-total // len(order))
            order = order.repeat(reps)
        return order[:total][self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        shard = self.shard(self.epoch)
        self._iter_start = self.position
        while self.position < len(shard):
            idx = int(shard[self.position])
            self.position += 1
            yield idx
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Exact position; ``consumed`` overrides the count of samples yielded (prefetching)."""
        position = self.position if consumed is None else self._iter_start + consumed
        epoch = self.epoch
        if position >= len(self):
            epoch, position = epoch + 1, 0
        return {
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "world_size": self.world_size,
            "num_indices": len(self.indices),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses a state from a different seed, world size or data."""
        for key, mine in (
            ("seed", self.seed),
            ("world_size", self.world_size),
            ("num_indices", len(self.indices)),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has {key}={mine}; "
                    "resume with the same dataset, seed and data-parallel size"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
