"""The data of a training run: the training batches of every step and the held-out set.

The training samples are cut into micro-batches once per epoch (``data.batching``: bucketed
by shape or packed by a token budget, :class:`~longboat.diffusion.data.LatentBatchSampler`)
and core's global batch plan orders them: one ``torch`` permutation of an epoch's batches,
wrapped around to a multiple of the data-parallel size; step ``s`` takes the next ``global /
micro`` batches, rank ``r``'s micro-batch ``a`` being the step's ``a * dp + r``-th
(context-parallel ranks of one data-parallel rank read the same batches). What a step reads
is a pure function of the step, so a run resumes at any step, with any number of loader
workers prefetching. The held-out samples are batched once, by shape, in a fixed order;
data-parallel rank ``r`` evaluates batches ``r, r + dp, ...``, so the held-out loss is the
same at any layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from longboat.core.data.batch_plan import BatchLayout, DataPosition, GlobalBatchPlan
from longboat.core.device.transfer import to_device
from longboat.diffusion.data.batching import LatentBatchSampler, collate_latents
from longboat.diffusion.data.dataset import LatentDataset
from longboat.diffusion.data.loading import dataset_paths, eval_dataset_paths

__all__ = ["RunData", "TrainingBatches", "batch_plan", "noise_seed", "open_run_data"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_EVAL_STREAM = 0x5EED_E7A1
"""Tag of the held-out noise seeds (kept apart from the training steps')."""


def noise_seed(*parts: int) -> int:
    """A 63-bit seed from non-negative integers (``SeedSequence``: distinct tuples give
    unrelated streams)."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def model_kwargs(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's inputs beyond latents and text on ``device``: ``pooled_embeds`` where the
    data carry them (FLUX), else none."""
    pooled = batch.get("pooled_embeds")
    return {} if pooled is None else {"pooled_embeds": to_device(pooled, device)}


IDENTITY_KEYS = {
    "seed": "data.seed",
    "shuffle": "data.shuffle",
    "global_batch": "train.global_batch_size",
    "mode": "data.batching",
    "batch_size": "train.micro_batch_size",
    "max_tokens": "data.max_tokens",
    "drop_last": "data.drop_last",
    "dataset_samples": "the dataset (data.path, data.paths, the synthetic set's size)",
}
"""What fixes the order of the training batches, and the config that sets each."""


@dataclass
class TrainingBatches:
    """The training samples, their batches and the plan that orders them."""

    dataset: LatentDataset
    sampler: LatentBatchSampler
    """The batches of each epoch (``epoch_batches``)."""
    plan: GlobalBatchPlan
    """Which of an epoch's batches every rank trains at every step."""
    packed: bool
    """Batches hold a list of latents (``batching=pack``) rather than one padded tensor."""
    collate: Any
    """Samples -> a micro-batch of model inputs."""

    def step_batches(self, step: int, dp_rank: int) -> list[dict[str, Any]]:
        """Rank ``dp_rank``'s collated micro-batches of ``step``."""
        return [
            self.collate([self.dataset[i] for i in self.sampler.epoch_batches(epoch)[b]])
            for [(epoch, b)] in self.plan.rank_entries(step, dp_rank)  # one batch a micro-batch
        ]

    def position(self) -> DataPosition:
        """The checkpoint's ``data`` entry: the identity of the order (the step is the
        position); a checkpoint of another order is refused naming the keys."""
        s = self.sampler
        extra = {
            "mode": s.mode,
            "batch_size": s.batch_size,
            "max_tokens": s.max_tokens,
            "drop_last": s.drop_last,
            "dataset_samples": len(s.shapes),
        }
        return DataPosition(self.plan, IDENTITY_KEYS, extra)

    def state_dict(self) -> dict[str, Any]:
        return self.position().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position().load_state_dict(state)


@dataclass
class RunData:
    """What a run reads (see the module doc)."""

    train: TrainingBatches
    """The training batches (``state_dict`` is the identity of their order)."""
    held_out: LatentDataset | None
    """The held-out set (None: no held-out loss, no preview)."""
    eval_batches: list[dict[str, Any]]
    """This rank's held-out batches, collated."""
    eval_count: int
    """Held-out samples over all data-parallel ranks."""
    seed: int
    """Seed of the held-out noise."""
    dp_rank: int
    """This process's data-parallel rank."""
    num_workers: int = 0
    """Loader processes that build the steps ahead of the training loop."""
    pin_memory: bool = False
    """The loader pins each step's batches (for asynchronous copies to the device)."""

    def micro_batches(self, start_step: int) -> Iterator[list[dict[str, Any]]]:
        """This rank's micro-batches of every step from ``start_step`` on, a list a step
        (built ahead by ``num_workers`` loader processes)."""
        from longboat.core.data.step_loader import step_batches

        return step_batches(
            partial(self.train.step_batches, dp_rank=self.dp_rank),
            start_step,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )

    def eval_noise(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """Fixed float32 noise of each held-out sample of ``batch`` (seeded by its index)."""
        out = []
        for i, x in zip(batch["indices"].tolist(), batch["latents"], strict=True):
            gen = torch.Generator().manual_seed(noise_seed(self.seed, _EVAL_STREAM, i))
            out.append(torch.randn(x.shape, generator=gen, dtype=torch.float32))
        return out


def batch_plan(
    num_batches: int, layout: BatchLayout, *, seed: int, shuffle: bool
) -> GlobalBatchPlan:
    """Core's plan over an epoch's ``num_batches`` micro-batches for ``layout`` (in samples):
    one ``torch`` permutation of the batch numbers per epoch (seed ``seed + epoch``), wrapped
    around to a multiple of the data-parallel size; rank ``r``'s micro-batch ``a`` of a step
    is its ``a * dp + r``-th."""
    in_batches = BatchLayout(layout.global_batch // layout.micro_batch, 1, layout.dp_size)
    return GlobalBatchPlan(
        num_batches, in_batches, seed=seed, shuffle=shuffle, permutation="torch",
        deal="micro_major", pad_epochs=True,
    )  # fmt: skip


def open_run_data(
    cfg: Any,
    layout: BatchLayout,
    *,
    dp_rank: int,
    is_main: bool,
    patch_size: tuple[int, ...],
    pin_memory: bool = False,
) -> RunData:
    """Open (the quickstart: first write) the datasets of ``cfg.data`` for this rank of
    ``layout`` (``pin_memory``: the training loader pins its batches)."""
    data, dp = cfg.data, layout.dp_size
    if is_main:  # the synthetic sets are written once, by one rank
        dataset_paths(data)
        eval_dataset_paths(data)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    data.validate("data")
    dataset = LatentDataset(
        dataset_paths(data), verify=data.verify, skip_bad_samples=data.skip_bad_samples
    )
    sampler = LatentBatchSampler(
        dataset.shapes, batch_size=layout.micro_batch, mode=data.batching,
        max_tokens=data.max_tokens, patch_size=tuple(data.patch_size), shuffle=data.shuffle,
        seed=data.seed, drop_last=data.drop_last, num_replicas=1, rank=0,
    )  # fmt: skip
    plan = batch_plan(sampler.num_batches, layout, seed=data.seed, shuffle=data.shuffle)
    packed = data.batching == "pack"
    train = TrainingBatches(
        dataset=dataset, sampler=sampler, plan=plan, packed=packed,
        collate=partial(collate_latents, packed=packed, dtype=_DTYPES[data.dtype]),
    )  # fmt: skip
    held_out, batches, count = None, [], 0
    paths = eval_dataset_paths(data)
    if paths:
        held_out = LatentDataset(paths, verify=data.verify, skip_bad_samples=data.skip_bad_samples)
        shapes = held_out.shapes
        limit = cfg.diffusion.eval_samples
        if limit > 0:
            shapes = shapes[:limit]
        count = len(shapes)
        order = LatentBatchSampler(
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
            collate_latents([held_out[i] for i in b], dtype=dtype) for b in list(order)[dp_rank::dp]
        ]
    return RunData(
        train=train, held_out=held_out, eval_batches=batches, eval_count=count, seed=data.seed,
        dp_rank=dp_rank, num_workers=data.num_workers, pin_memory=pin_memory,
    )  # fmt: skip
