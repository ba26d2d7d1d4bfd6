"""The data of a training run: the resumable training loader and the held-out set.

Training batches come from :func:`~longboat.diffusion.data.build_latent_loader` for this
data-parallel rank (context-parallel ranks of one data-parallel rank read the same batches).
The held-out samples are batched once, by shape, in a fixed order; data-parallel rank ``r``
evaluates batches ``r, r + dp, ...``, so the held-out loss is the same at any layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from longboat.diffusion.data.batching import LatentBatchSampler, collate_latents
from longboat.diffusion.data.dataset import LatentDataset
from longboat.diffusion.data.loading import (
    LatentLoader,
    build_latent_loader,
    dataset_paths,
    eval_dataset_paths,
)

__all__ = ["RunData", "noise_seed", "open_run_data"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_EVAL_STREAM = 0x5EED_E7A1
"""Tag of the held-out noise seeds (kept apart from the training steps')."""


def noise_seed(*parts: int) -> int:
    """A 63-bit seed from non-negative integers (``SeedSequence``: distinct tuples give
    unrelated streams)."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


@dataclass
class RunData:
    """What a run reads (see the module doc)."""

    train: LatentLoader
    """This data-parallel rank's training batches (``state_dict`` is the data position)."""
    held_out: LatentDataset | None
    """The held-out set (None: no held-out loss, no preview)."""
    eval_batches: list[dict[str, Any]]
    """This rank's held-out batches, collated."""
    eval_count: int
    """Held-out samples over all data-parallel ranks."""
    seed: int
    """Seed of the held-out noise."""

    def micro_batches(self, per_step: int) -> Iterator[list[dict[str, Any]]]:
        """``per_step`` micro-batches at a time, from the loader's current position on
        (epochs follow one another)."""
        it = iter(self.train.loader)
        while True:
            out: list[dict[str, Any]] = []
            while len(out) < per_step:
                try:
                    out.append(next(it))
                except StopIteration:
                    it = iter(self.train.loader)  # the sampler moves to the next epoch
            yield out

    def eval_noise(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """Fixed float32 noise of each held-out sample of ``batch`` (seeded by its index)."""
        out = []
        for i, x in zip(batch["indices"].tolist(), batch["latents"], strict=True):
            gen = torch.Generator().manual_seed(noise_seed(self.seed, _EVAL_STREAM, i))
            out.append(torch.randn(x.shape, generator=gen, dtype=torch.float32))
        return out


def open_run_data(
    cfg: Any,
    *,
    dp: int,
    dp_rank: int,
    is_main: bool,
    patch_size: tuple[int, ...],
    pin_memory: bool = False,
) -> RunData:
    """Open (the quickstart: first write) the datasets of ``cfg.data`` for this rank
    (``pin_memory``: the training loader pins its batches)."""
    data = cfg.data
    if is_main:  # the synthetic sets are written once, by one rank
        dataset_paths(data)
        eval_dataset_paths(data)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    train = build_latent_loader(
        data, batch_size=cfg.train.micro_batch_size, num_replicas=dp, rank=dp_rank,
        pin_memory=pin_memory,
    )  # fmt: skip
    held_out, batches, count = None, [], 0
    paths = eval_dataset_paths(data)
    if paths:
        held_out = LatentDataset(paths, verify=data.verify)
        shapes = held_out.shapes
        limit = cfg.diffusion.eval_samples
        if limit > 0:
            shapes = shapes[:limit]
        count = len(shapes)
        plan = LatentBatchSampler(
            shapes,
            batch_size=cfg.diffusion.eval_batch_size,
            mode="bucket",
            patch_size=patch_size,
            shuffle=False,
            num_replicas=1,
            rank=0,
        )
        dtype = _DTYPES[data.dtype]
        batches = [
            collate_latents([held_out[i] for i in b], dtype=dtype) for b in list(plan)[dp_rank::dp]
        ]
    return RunData(
        train=train, held_out=held_out, eval_batches=batches, eval_count=count, seed=data.seed
    )
