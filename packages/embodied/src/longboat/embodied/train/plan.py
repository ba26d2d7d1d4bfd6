"""Which samples each rank trains on at each step: a pure function of the step.

The global sample stream is the concatenation of per-epoch orders of core's
``StatefulDistributedSampler`` (one replica: the global order). Step ``s`` takes
``global_batch`` consecutive entries; its micro-batch ``m`` (0..dp*accum-1) is
the ``m``-th slice of ``micro_batch`` of them, and data-parallel rank ``r`` owns
micro-batches ``r*accum .. r*accum+accum-1``. Because nothing depends on how far
an iterator ran, resume (at any world size, with any number of loader workers
prefetching) only needs the step number (the trainer's checkpointed ``step``) and the
identity of the order (``DataPosition``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from longboat.core.checkpoint.errors import CheckpointError
from longboat.core.data.sampler import StatefulDistributedSampler


@dataclass(frozen=True)
class BatchLayout:
    """Batch sizes of one run."""

    global_batch: int
    """Samples per optimizer step over all ranks."""
    micro_batch: int
    """Samples per forward/backward on one rank."""
    dp_size: int
    """Data-parallel ranks."""

    @property
    def accum(self) -> int:
        """Gradient-accumulation micro-batches per rank and step."""
        return self.global_batch // (self.micro_batch * self.dp_size)


def batch_layout(global_batch_size: int | None, micro_batch_size: int, dp_size: int) -> BatchLayout:
    """The layout of ``train.global_batch_size`` (samples per optimizer step over all ranks,
    fixed when the data-parallel size changes; None: ``micro_batch_size x dp_size``), as in
    the LLM stack. Core's validator has checked that it divides into micro-batches."""
    return BatchLayout(global_batch_size or micro_batch_size * dp_size, micro_batch_size, dp_size)


class GlobalBatchPlan:
    """Deterministic, world-size-independent sample order cut into steps and micro-batches."""

    def __init__(self, num_samples: int, layout: BatchLayout, *, seed: int, shuffle: bool) -> None:
        self.layout = layout
        self.num_samples = num_samples
        self.sampler = StatefulDistributedSampler(
            num_samples, num_replicas=1, rank=0, shuffle=shuffle, seed=seed
        )
        self._epochs: dict[int, list[int]] = {}
        self._step_cache: tuple[int, list[int]] | None = None

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            self.sampler.set_epoch(epoch)
            order = list(iter(self.sampler))
            # Two epochs cached: a step that straddles an epoch boundary needs both.
            self._epochs = {e: o for e, o in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = order
        return self._epochs[epoch]

    def global_indices(self, step: int) -> list[int]:
        """The ``global_batch`` sample indices of ``step``."""
        if self._step_cache is not None and self._step_cache[0] == step:
            return self._step_cache[1]
        n, gb = self.num_samples, self.layout.global_batch
        out = [self._epoch_order(pos // n)[pos % n] for pos in range(step * gb, (step + 1) * gb)]
        self._step_cache = (step, out)
        return out

    def micro_batch_indices(self, step: int, micro_index: int) -> list[int]:
        """Sample indices of global micro-batch ``micro_index`` of ``step``."""
        mb = self.layout.micro_batch
        return self.global_indices(step)[micro_index * mb : (micro_index + 1) * mb]

    def rank_micro_batches(self, step: int, dp_rank: int) -> list[list[int]]:
        """This rank's micro-batches of ``step`` (``accum`` lists of ``micro_batch`` indices)."""
        first = dp_rank * self.layout.accum
        return [self.micro_batch_indices(step, first + a) for a in range(self.layout.accum)]

    def state_dict(self, step: int) -> dict[str, Any]:
        """Position after ``step`` completed steps, in the sampler's (epoch, position) terms."""
        consumed = step * self.layout.global_batch
        return {
            "epoch": consumed // self.num_samples,
            "position": consumed % self.num_samples,
            "seed": self.sampler.seed,
            "shuffle": self.sampler.shuffle,
            "num_samples": self.num_samples,
            "global_batch": self.layout.global_batch,
        }


IDENTITY_KEYS = {
    "seed": "data.seed",
    "shuffle": "data.shuffle",
    "num_samples": "the dataset (data.path, data.synthetic.*, data.eval_episodes)",
    "global_batch": "train.global_batch_size",
    "held_out": "data.eval_episodes",
}
"""What fixes the sample order, and the config that sets each."""


class DataPosition:
    """The data entry of a checkpoint: the identity of the sample order.

    The trainer checkpoints the step; the plan maps a step to its samples, so the position
    is the step itself. What this saves is what makes the order the same: a checkpoint of
    another order (seed, shuffle, dataset size, global batch or held-out episodes; a
    checkpoint from before the held-out set was recorded is not checked for it) is refused naming every key
    that differs and the fix, instead of resuming on other samples.
    """

    def __init__(self, plan: GlobalBatchPlan, held_out: list[list[int]] | None = None) -> None:
        """``held_out``: the episodes ``data.eval_episodes`` keeps out of each sub-dataset
        (another held-out set is another order, even at the same sample count)."""
        self.plan = plan
        self.held_out = [list(map(int, h)) for h in held_out or []]

    def state_dict(self) -> dict[str, Any]:
        order = {**self.plan.state_dict(0), "held_out": self.held_out}
        return {key: order[key] for key in IDENTITY_KEYS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        bad = [key for key in IDENTITY_KEYS if key in state and state[key] != mine[key]]
        if not bad:
            return
        pairs = ", ".join(f"{key}={state[key]!r} (this run: {mine[key]!r})" for key in bad)
        where = ", ".join(IDENTITY_KEYS[key] for key in bad)
        raise CheckpointError(
            f"the checkpoint's data order has {pairs}. Fix: resume with the same {where}, "
            "or start over with checkpoint.resume=none"
        )
