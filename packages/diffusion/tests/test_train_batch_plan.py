"""The training batches of every step: core's global batch plan over an epoch's micro-batches
draws, per rank, the batches the sharded batch sampler hands that rank, at any step."""

from __future__ import annotations

import numpy as np
import pytest

from longboat.core.data.batch_plan import batch_layout
from longboat.diffusion.data.batching import LatentBatchSampler
from longboat.diffusion.train.data import batch_plan


@pytest.mark.parametrize(
    ("mode", "micro", "dp", "accum", "shuffle"),
    [("bucket", 2, 2, 2, True), ("bucket", 3, 3, 1, False), ("pack", 1, 2, 3, True)],
)
def test_each_rank_trains_the_batches_the_sharded_sampler_gives_it(
    mode: str, micro: int, dp: int, accum: int, shuffle: bool
) -> None:
    shapes = np.random.default_rng(0).integers(1, 3, (13, 3))
    kw = {"batch_size": micro, "mode": mode, "max_tokens": 12, "patch_size": (1, 1, 1)}
    kw |= {"shuffle": shuffle, "seed": 5}
    batches = LatentBatchSampler(shapes, num_replicas=1, rank=0, **kw)
    plan = batch_plan(
        batches.num_batches, batch_layout(micro * dp * accum, micro, dp), seed=5, shuffle=shuffle
    )
    steps = 3 * batches.num_batches  # several epochs, each padded to the ranks
    for rank in range(dp):
        sharded = LatentBatchSampler(shapes, num_replicas=dp, rank=rank, **kw)
        drawn: list[list[int]] = []
        while len(drawn) < steps * accum:
            drawn += list(iter(sharded))  # the next pass is the next epoch
        planned = [
            batches.epoch_batches(epoch)[b]
            for step in range(steps)
            for [(epoch, b)] in plan.rank_entries(step, rank)
        ]
        assert planned == drawn[: steps * accum]
        # A plan built fresh at step k (a resumed run) draws the same tail.
        fresh = batch_plan(batches.num_batches, plan.layout, seed=5, shuffle=shuffle)
        k = steps // 2
        tail = [fresh.rank_entries(s, rank) for s in range(k, steps)]
        assert tail == [plan.rank_entries(s, rank) for s in range(k, steps)]
