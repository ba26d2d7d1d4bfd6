"""A DataLoader that yields this rank's collated micro-batches, step after step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from longboat.core.data.batch_plan import GlobalBatchPlan
from longboat.core.engine.torch.step import micro_batch_seed
from longboat.core.loop.signals import ignore_sigint

_DATA_SALT = 0x5EED_DA7A  # data-side RNG stream, distinct from the model-side one


class RankMicroBatches(Dataset):
    """Item ``k`` = micro-batch ``k % accum`` of step ``k // accum`` for one data-parallel rank.

    Loading runs under a CPU RNG seeded from (seed, step, global micro-batch index),
    so random augmentation is reproducible at any world size and after resume,
    in the main process or in loader workers alike.
    """

    def __init__(
        self,
        samples: Dataset,
        plan: GlobalBatchPlan,
        collate: Callable[[Sequence[dict[str, Any]]], dict[str, Any]],
        *,
        dp_rank: int,
        seed: int,
    ) -> None:
        self.samples = samples
        self.plan = plan
        self.collate = collate
        self.dp_rank = dp_rank
        self.seed = seed

    def __len__(self) -> int:  # pragma: no cover - the sampler bounds the range
        raise TypeError("RankMicroBatches is indexed by (step * accum + micro); it has no length")

    def __getitem__(self, k: int) -> dict[str, Any]:
        accum = self.plan.layout.accum
        step, a = divmod(k, accum)
        micro = self.dp_rank * accum + a
        indices = self.plan.micro_batch_indices(step, micro)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(micro_batch_seed(self.seed ^ _DATA_SALT, step, micro))
            return self.collate([self.samples[i] for i in indices])


def build_loader(
    data: RankMicroBatches,
    *,
    start_step: int,
    total_steps: int,
    num_workers: int,
    pin_memory: bool = False,
) -> DataLoader:
    """Loader over micro-batches of steps ``start_step .. total_steps-1`` (in order).

    ``pin_memory`` (for GPU training) lets the host-to-device copies run asynchronously;
    workers ignore SIGINT (``ignore_sigint``)."""
    accum = data.plan.layout.accum
    return DataLoader(
        data,
        batch_size=None,
        sampler=range(start_step * accum, total_steps * accum),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        prefetch_factor=2 if num_workers > 0 else None,
        worker_init_fn=ignore_sigint if num_workers > 0 else None,
    )
