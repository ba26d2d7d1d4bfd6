"""Which samples each rank trains on at each step: core's global batch plan over the
training samples, and the identity of its order in a checkpoint.

The global sample stream is one ``torch`` permutation of the samples per epoch (the order
core's ``StatefulDistributedSampler`` draws at one replica). Step ``s`` takes
``global_batch`` consecutive entries; its micro-batch ``m`` (0..dp*accum-1) is the ``m``-th
slice of ``micro_batch`` of them, and data-parallel rank ``r`` owns micro-batches
``r*accum .. r*accum+accum-1``. Because nothing depends on how far an iterator ran, resume
(at any world size, with any number of loader workers prefetching) only needs the step
number (the trainer's checkpointed ``step``) and the identity of the order
(:func:`data_position`).
"""

from __future__ import annotations

from longboat.core.data.batch_plan import BatchLayout, DataPosition, GlobalBatchPlan

IDENTITY_KEYS = {
    "seed": "data.seed",
    "shuffle": "data.shuffle",
    "num_samples": "the dataset (data.path, data.synthetic.*, data.eval_episodes)",
    "global_batch": "train.global_batch_size",
    "held_out": "data.eval_episodes",
}
"""What fixes the sample order, and the config that sets each."""


def sample_plan(
    num_samples: int, layout: BatchLayout, *, seed: int, shuffle: bool
) -> GlobalBatchPlan:
    """The run's plan over its ``num_samples`` training samples (see the module doc)."""
    return GlobalBatchPlan(
        num_samples, layout, seed=seed, shuffle=shuffle, permutation="torch", deal="rank_major"
    )


def data_position(plan: GlobalBatchPlan, held_out: list[list[int]] | None = None) -> DataPosition:
    """The checkpoint's ``data`` entry: a checkpoint of another order (seed, shuffle, dataset
    size, global batch or held-out episodes; a checkpoint from before the held-out set was
    recorded is not checked for it) is refused naming every key that differs and the fix.

    ``held_out``: the episodes ``data.eval_episodes`` keeps out of each sub-dataset (another
    held-out set is another order, even at the same sample count)."""
    episodes = [list(map(int, h)) for h in held_out or []]
    return DataPosition(plan, IDENTITY_KEYS, {"held_out": episodes})
