"""The global batch plan every stack trains on: which samples each data-parallel rank's
micro-batches take at each step, as a pure function of the step.

The sizes (:class:`BatchLayout`): ``train.global_batch_size`` samples per optimizer step over
all ranks, ``train.micro_batch_size`` per forward / backward on one rank, ``dp_size``
data-parallel ranks, so every rank accumulates ``global / (micro x dp)`` micro-batches a step.
:func:`batch_size_problem` is the one divisibility check: core's config validation runs it
before any work, and :func:`batch_layout` raises it again once the data-parallel size is
known.

The order (:class:`GlobalBatchPlan`): the sample stream is one permutation of the samples per
epoch, laid end to end (``permutation`` names how an epoch's permutation is drawn from the
seed; ``pad_epochs`` wraps each epoch around to a multiple of ``dp_size``, so every rank gets
the same count of an epoch). Step ``s`` takes the ``global_batch`` consecutive entries from
``s * global_batch`` on, cut into ``dp_size * accum`` micro-batches of ``micro_batch``, and the
``deal`` says which micro-batches a rank trains: ``micro_major`` (micro-batch ``a`` of rank
``r`` is the step's ``a * dp + r``-th) or ``rank_major`` (rank ``r`` owns ``r * accum`` to
``r * accum + accum - 1``). With per-sample ``costs``, the step's samples are instead dealt by
cost (core's :func:`~longboat.core.data.balance.balance`, each rank getting the same count):
the global batch, and so the step's loss, stays the same; only who computes what changes.

Nothing depends on how far an iterator ran, so a run resumes at any step from the step
number alone (with any number of loader workers prefetching).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from longboat.core.config.errors import ConfigError, ConfigProblem
from longboat.core.data.balance import Assignment, balance

__all__ = [
    "DEALS",
    "PERMUTATIONS",
    "BatchLayout",
    "DataPosition",
    "GlobalBatchPlan",
    "batch_layout",
    "batch_size_problem",
    "epoch_permutation",
    "mean_imbalance",
]

PERMUTATIONS = ("torch", "numpy", "numpy_summed_seed")
"""How an epoch's permutation is drawn (:func:`epoch_permutation`)."""

DEALS = ("micro_major", "rank_major")
"""Which of a step's micro-batches a data-parallel rank trains (see the module doc)."""


@dataclass(frozen=True)
class BatchLayout:
    """Batch sizes of one run."""

    global_batch: int
    """Samples per optimizer step over all data-parallel ranks."""
    micro_batch: int
    """Samples per forward / backward on one rank."""
    dp_size: int
    """Data-parallel ranks."""

    @property
    def accum(self) -> int:
        """Gradient-accumulation micro-batches per rank and step."""
        return self.global_batch // (self.micro_batch * self.dp_size)

    @property
    def micro_batches(self) -> int:
        """Micro-batches of a step over all ranks (``dp_size x accum``)."""
        return self.global_batch // self.micro_batch


def batch_size_problem(
    global_batch_size: int | None, micro_batch_size: int, dp_size: int | None
) -> ConfigProblem | None:
    """What is wrong with ``train.global_batch_size`` / ``train.micro_batch_size`` at
    ``dp_size`` data-parallel ranks (None: unknown yet, only the micro-batch is checked), or
    None when the global batch divides into micro-batches on every rank. A null global batch
    is ``micro x dp``."""
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        return ConfigProblem(
            key="train.micro_batch_size",
            message="must be >= 1",
            value=micro_batch_size,
            fix="use a positive number of samples per forward / backward",
        )
    if global_batch_size is None:
        return None
    if global_batch_size < 1:
        return ConfigProblem(
            key="train.global_batch_size",
            message="must be >= 1 or null",
            value=global_batch_size,
            fix="use null",
        )
    per_step = micro_batch_size * (dp_size or 1)
    if global_batch_size % per_step == 0:
        return None
    dp_text = f" x data_parallel={dp_size}" if dp_size is not None else ""
    return ConfigProblem(
        key="train.global_batch_size",
        message=f"is not divisible by micro_batch_size={micro_batch_size}{dp_text} = {per_step}",
        value=global_batch_size,
        fix=f"use a multiple of {per_step} (gradient accumulation steps = gbs / {per_step}), "
        "or change train.micro_batch_size",
    )


def batch_layout(global_batch_size: int | None, micro_batch_size: int, dp_size: int) -> BatchLayout:
    """The layout of ``train.global_batch_size`` (fixed when the data-parallel size changes;
    None: ``micro_batch_size x dp_size``) at ``dp_size`` ranks; a global batch that does not
    divide into micro-batches on every rank raises ``ConfigError`` naming the key and the fix."""
    problem = batch_size_problem(global_batch_size, micro_batch_size, dp_size)
    if problem is not None:
        raise ConfigError(problem)
    return BatchLayout(global_batch_size or micro_batch_size * dp_size, micro_batch_size, dp_size)


def epoch_permutation(num_samples: int, seed: int, epoch: int, permutation: str) -> np.ndarray:
    """Epoch ``epoch``'s order of ``num_samples`` samples (int64): ``torch``: ``torch.randperm``
    seeded with ``seed + epoch`` (core's ``StatefulDistributedSampler``); ``numpy``: numpy's
    generator seeded with ``[seed, epoch]``; ``numpy_summed_seed``: seeded with
    ``seed + epoch``."""
    if permutation == "torch":
        import torch

        gen = torch.Generator()
        gen.manual_seed(seed + epoch)
        return torch.randperm(num_samples, generator=gen).numpy().astype(np.int64)
    if permutation == "numpy":
        return np.random.default_rng([seed, epoch]).permutation(num_samples)
    if permutation == "numpy_summed_seed":
        return np.random.default_rng(seed + epoch).permutation(num_samples)
    raise ValueError(f"permutation={permutation!r} is not one of {PERMUTATIONS}")


class GlobalBatchPlan:
    """Deterministic sample order cut into steps, ranks and micro-batches (module doc).

    Args:
        num_samples: samples (rows, episodes' frames, pre-formed batches) to draw from.
        layout: the run's batch sizes.
        seed: seed of the per-epoch permutations.
        shuffle: permute each epoch (else every epoch is ``0 .. num_samples - 1``).
        permutation: how an epoch's permutation is drawn (:data:`PERMUTATIONS`).
        deal: which micro-batches of a step each rank trains (:data:`DEALS`).
        pad_epochs: wrap each epoch's order around to a multiple of ``dp_size``.
        costs: per-sample cost; given, with more than one rank, each step's samples are
            dealt to the ranks by cost (same count each) instead of by ``deal``.
    """

    def __init__(
        self,
        num_samples: int,
        layout: BatchLayout,
        *,
        seed: int,
        shuffle: bool = True,
        permutation: str = "torch",
        deal: str = "rank_major",
        pad_epochs: bool = False,
        costs: np.ndarray | None = None,
    ) -> None:
        if num_samples < 1:
            raise ValueError("the plan needs at least one sample")
        if permutation not in PERMUTATIONS:
            raise ValueError(f"permutation={permutation!r} is not one of {PERMUTATIONS}")
        if deal not in DEALS:
            raise ValueError(f"deal={deal!r} is not one of {DEALS}")
        if costs is not None and len(costs) != num_samples:
            raise ValueError(f"{len(costs)} costs for {num_samples} samples")
        self.num_samples, self.layout = num_samples, layout
        self.seed, self.shuffle, self.permutation = seed, shuffle, permutation
        self.deal, self.pad_epochs = deal, pad_epochs
        self.costs = None if costs is None else np.asarray(costs, dtype=np.float64)
        dp = layout.dp_size
        self.epoch_length = -(-num_samples // dp) * dp if pad_epochs else num_samples
        """Entries of one epoch in the sample stream."""
        self._epochs: dict[int, np.ndarray] = {}
        self._step_cache: tuple[int, list[tuple[int, int]]] | None = None

    @property
    def balanced(self) -> bool:
        """Steps are dealt to the ranks by cost."""
        return self.costs is not None and self.layout.dp_size > 1

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The ``epoch_length`` sample indices of ``epoch``, in stream order."""
        if epoch not in self._epochs:
            n = self.num_samples
            if self.shuffle:
                order = epoch_permutation(n, self.seed, epoch, self.permutation)
            else:
                order = np.arange(n, dtype=np.int64)
            if self.epoch_length > n:
                order = np.resize(order, self.epoch_length)  # wraps around from the start
            # Two epochs cached: a step that straddles an epoch boundary needs both.
            self._epochs = {e: o for e, o in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = order
        return self._epochs[epoch]

    def global_entries(self, step: int) -> list[tuple[int, int]]:
        """``(epoch, sample index)`` of each of the ``global_batch`` entries of ``step``
        (0-based), in stream order."""
        if self._step_cache is not None and self._step_cache[0] == step:
            return self._step_cache[1]
        n, gb = self.epoch_length, self.layout.global_batch
        out = []
        for pos in range(step * gb, (step + 1) * gb):
            epoch, at = divmod(pos, n)
            out.append((epoch, int(self.epoch_order(epoch)[at])))
        self._step_cache = (step, out)
        return out

    def global_indices(self, step: int) -> list[int]:
        """The ``global_batch`` sample indices of ``step``, in stream order."""
        return [i for _, i in self.global_entries(step)]

    def micro_index(self, dp_rank: int, micro: int) -> int:
        """Which of the step's ``dp_size x accum`` micro-batches is rank ``dp_rank``'s
        ``micro``-th (by ``deal``; a balanced plan deals by cost instead)."""
        lay = self.layout
        if self.deal == "rank_major":
            return dp_rank * lay.accum + micro
        return micro * lay.dp_size + dp_rank

    def micro_batch_indices(self, step: int, micro_index: int) -> list[int]:
        """Sample indices of the step's micro-batch ``micro_index`` (0 .. dp x accum - 1)."""
        mb = self.layout.micro_batch
        return self.global_indices(step)[micro_index * mb : (micro_index + 1) * mb]

    def assignment(self, step: int, *, balanced: bool | None = None) -> Assignment:
        """Positions into ``global_indices(step)`` of each rank (ascending) and each rank's
        cost: dealt by cost (``balanced``, default: when the plan has costs and more than one
        rank) or by ``deal``. Without costs every sample costs 1."""
        lay = self.layout
        at = np.asarray(self.global_indices(step), dtype=np.int64)
        c = self.costs[at] if self.costs is not None else np.ones(len(at))
        if (self.balanced if balanced is None else balanced) and lay.dp_size > 1:
            return balance(c, lay.dp_size, per_rank=lay.global_batch // lay.dp_size)
        mb = lay.micro_batch
        ranks = [
            [self.micro_index(r, a) * mb + k for a in range(lay.accum) for k in range(mb)]
            for r in range(lay.dp_size)
        ]
        return Assignment(
            tuple(tuple(sorted(p)) for p in ranks),
            tuple(float(c[p].sum()) for p in ranks),
        )

    def rank_positions(self, step: int, dp_rank: int) -> list[list[int]]:
        """Positions into ``global_indices(step)`` of rank ``dp_rank``'s ``accum``
        micro-batches (each ``micro_batch`` long)."""
        lay, mb = self.layout, self.layout.micro_batch
        if self.balanced:
            mine = self.assignment(step).ranks[dp_rank]
            return [list(mine[a * mb : (a + 1) * mb]) for a in range(lay.accum)]
        starts = [self.micro_index(dp_rank, a) * mb for a in range(lay.accum)]
        return [list(range(s, s + mb)) for s in starts]

    def rank_entries(self, step: int, dp_rank: int) -> list[list[tuple[int, int]]]:
        """``(epoch, sample index)`` of rank ``dp_rank``'s micro-batches of ``step``."""
        entries = self.global_entries(step)
        return [[entries[p] for p in micro] for micro in self.rank_positions(step, dp_rank)]

    def rank_micro_batches(self, step: int, dp_rank: int) -> list[list[int]]:
        """Rank ``dp_rank``'s micro-batches of ``step``: ``accum`` lists of ``micro_batch``
        sample indices."""
        at = self.global_indices(step)
        return [[at[p] for p in micro] for micro in self.rank_positions(step, dp_rank)]

    def state_dict(self, step: int) -> dict[str, Any]:
        """The stream position after ``step`` completed steps (``epoch``, ``position`` in it)
        and what fixes the order."""
        epoch, position = divmod(step * self.layout.global_batch, self.epoch_length)
        return {
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "global_batch": self.layout.global_batch,
        }


def mean_imbalance(plan: GlobalBatchPlan, steps: int) -> tuple[float, float]:
    """Mean max / mean rank cost over the first ``steps`` steps of ``plan``: dealt by
    ``deal``, dealt by cost."""
    plain = [plan.assignment(s, balanced=False).imbalance for s in range(steps)]
    dealt = [plan.assignment(s, balanced=True).imbalance for s in range(steps)]
    return float(np.mean(plain)), float(np.mean(dealt))


class DataPosition:
    """The ``data`` entry of a checkpoint for a run on a :class:`GlobalBatchPlan`: the
    identity of its sample order.

    The trainer checkpoints the step and the plan maps a step to its samples, so the position
    is the step itself. What this saves is what makes the order the same; a checkpoint of
    another order (a key of ``keys`` that differs; one the checkpoint lacks is not checked)
    is refused naming every key that differs, the config that sets it and the fix, instead
    of resuming on other samples.

    Args:
        plan: the run's plan.
        keys: identity entry -> the config that sets it, for ``seed``, ``shuffle``,
            ``num_samples``, ``global_batch`` (the plan's) and those of ``extra``.
        extra: more of the order's identity (e.g. held-out episodes).
    """

    def __init__(
        self,
        plan: GlobalBatchPlan,
        keys: Mapping[str, str],
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        self.plan, self.keys, self.extra = plan, dict(keys), dict(extra or {})

    def state_dict(self) -> dict[str, Any]:
        order = {**self.plan.state_dict(0), **self.extra}
        return {key: order[key] for key in self.keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        bad = [key for key in self.keys if key in state and state[key] != mine[key]]
        if not bad:
            return
        from longboat.core.checkpoint.errors import CheckpointError

        pairs = ", ".join(f"{key}={state[key]!r} (this run: {mine[key]!r})" for key in bad)
        where = ", ".join(self.keys[key] for key in bad)
        raise CheckpointError(
            f"the checkpoint's data order has {pairs}. Fix: resume with the same {where}, "
            "or start over with checkpoint.resume=none"
        )
