"""The global batch plan: exact index sets, the divisibility error, resume at any step, the
balanced deal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longboat.core.checkpoint.errors import CheckpointError
from longboat.core.config.errors import ConfigError
from longboat.core.data.batch_plan import (
    BatchLayout,
    DataPosition,
    GlobalBatchPlan,
    batch_layout,
    batch_size_problem,
    epoch_permutation,
    mean_imbalance,
)
from longboat.core.data.sampler import StatefulDistributedSampler


def _plan(n: int, gb: int, mb: int, dp: int, **kw) -> GlobalBatchPlan:
    return GlobalBatchPlan(n, BatchLayout(gb, mb, dp), seed=3, **kw)


def test_layout_accumulates_the_rest_of_the_global_batch() -> None:
    lay = batch_layout(12, 2, 3)
    assert (lay.global_batch, lay.micro_batch, lay.dp_size, lay.accum) == (12, 2, 3, 2)
    assert lay.micro_batches == 6
    assert batch_layout(None, 4, 2) == BatchLayout(8, 4, 2)  # null: micro x dp


def test_a_global_batch_that_does_not_divide_is_a_config_error_naming_the_keys() -> None:
    with pytest.raises(ConfigError) as err:
        batch_layout(10, 2, 2)
    (problem,) = err.value.problems
    assert problem.key == "train.global_batch_size" and problem.value == 10
    assert problem.message == "is not divisible by micro_batch_size=2 x data_parallel=2 = 4"
    assert "multiple of 4" in problem.fix and "train.micro_batch_size" in problem.fix
    # The data-parallel size not known yet (config validation before launch): micro only.
    assert batch_size_problem(7, 2, None).message == "is not divisible by micro_batch_size=2 = 2"
    assert batch_size_problem(0, 2, 1).message == "must be >= 1 or null"
    assert batch_size_problem(8, 0, 1).key == "train.micro_batch_size"
    assert batch_size_problem(12, 2, 3) is None and batch_size_problem(None, 2, 5) is None


def test_sequential_index_sets_of_both_deals() -> None:
    # 10 samples, global 8 = micro 2 x dp 2 x accum 2; no shuffle: the stream is 0..9, 0..9.
    micro = _plan(10, 8, 2, 2, shuffle=False, deal="micro_major")
    assert micro.global_indices(0) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert micro.global_indices(1) == [8, 9, 0, 1, 2, 3, 4, 5]  # crosses into epoch 1
    assert micro.global_entries(1)[:3] == [(0, 8), (0, 9), (1, 0)]
    # micro_major: micro-batch a of rank r is the step's (a * dp + r)-th.
    assert micro.rank_micro_batches(0, 0) == [[0, 1], [4, 5]]
    assert micro.rank_micro_batches(0, 1) == [[2, 3], [6, 7]]
    # rank_major: rank r owns micro-batches r * accum .. r * accum + accum - 1.
    rank = _plan(10, 8, 2, 2, shuffle=False, deal="rank_major")
    assert rank.rank_micro_batches(0, 0) == [[0, 1], [2, 3]]
    assert rank.rank_micro_batches(1, 1) == [[2, 3], [4, 5]]
    assert rank.micro_batch_indices(1, rank.micro_index(1, 1)) == [4, 5]


def test_shuffled_order_is_each_permutation_and_its_epoch_boundaries() -> None:
    plan = _plan(6, 4, 1, 1, permutation="numpy")
    e0 = list(np.random.default_rng([3, 0]).permutation(6))
    e1 = list(np.random.default_rng([3, 1]).permutation(6))
    stream = e0 + e1
    assert [plan.global_indices(s) for s in range(3)] == [stream[0:4], stream[4:8], stream[8:12]]
    summed = _plan(6, 3, 1, 1, permutation="numpy_summed_seed")
    assert summed.global_indices(2) == list(np.random.default_rng(3 + 1).permutation(6))[:3]
    # torch: the order core's sampler draws at one replica.
    sampler = StatefulDistributedSampler(6, num_replicas=1, rank=0, seed=3)
    sampler.set_epoch(1)
    assert _plan(6, 6, 3, 2).global_indices(1) == list(iter(sampler))
    gen = torch.Generator().manual_seed(3 + 4)
    assert list(epoch_permutation(5, 3, 4, "torch")) == torch.randperm(5, generator=gen).tolist()


def test_padded_epochs_wrap_to_every_rank_and_match_the_sharded_sampler() -> None:
    # 5 batches over 2 ranks: every epoch is padded to 6 with its own first entry, and rank r
    # takes entries r, r + 2, ... as the sharded sampler hands them out.
    plan = _plan(5, 2, 1, 2, pad_epochs=True, deal="micro_major")
    assert plan.epoch_length == 6
    for r in range(2):
        sampler = StatefulDistributedSampler(5, num_replicas=2, rank=r, seed=3)
        drawn = []
        for _ in range(3):  # three epochs
            drawn += list(iter(sampler))
        mine = [mb[0] for s in range(9) for mb in plan.rank_micro_batches(s, r)]
        assert mine == drawn
    order = plan.epoch_order(0)
    assert list(order[5:]) == [order[0]]


def test_ranks_split_the_global_batch_and_each_epoch_is_a_permutation() -> None:
    for deal in ("micro_major", "rank_major"):
        plan = _plan(12, 6, 1, 3, deal=deal)
        for step in range(8):
            got = sorted(i for r in range(3) for mb in plan.rank_micro_batches(step, r) for i in mb)
            assert got == sorted(plan.global_indices(step))
        epoch0 = plan.global_indices(0) + plan.global_indices(1)
        epoch1 = plan.global_indices(2) + plan.global_indices(3)
        assert sorted(epoch0) == sorted(epoch1) == list(range(12)) and epoch0 != epoch1


def test_resume_at_step_k_is_the_tail_of_the_uninterrupted_plan() -> None:
    kw = {"deal": "micro_major", "pad_epochs": True, "permutation": "numpy"}
    full = _plan(13, 6, 3, 2, **kw)
    expected = [[full.rank_micro_batches(s, r) for r in range(2)] for s in range(12)]
    for k in (0, 1, 5, 11):
        fresh = _plan(13, 6, 3, 2, **kw)  # nothing carried over but the step number
        assert [[fresh.rank_micro_batches(s, r) for r in range(2)] for s in range(k, 12)] == (
            expected[k:]
        )
    state = full.state_dict(5)
    assert (state["epoch"], state["position"]) == divmod(5 * 6, 14)


def test_balanced_deal_keeps_the_global_batch_and_evens_the_cost() -> None:
    costs = np.array([100.0, 1, 1, 1, 90, 2, 2, 2, 80, 3, 3, 3])
    plan = _plan(12, 8, 1, 2, shuffle=False, deal="micro_major", costs=costs)
    assert plan.balanced
    # Step 0 holds samples 0..7 (costs 100 1 1 1 90 2 2 2): micro_major gives rank 0
    # positions 0 2 4 6 (100 + 1 + 90 + 2) and rank 1 the cheap rest.
    plain = plan.assignment(0, balanced=False)
    assert plain.ranks == ((0, 2, 4, 6), (1, 3, 5, 7)) and plain.costs == (193.0, 6.0)
    dealt = plan.assignment(0)
    assert dealt.ranks == ((0, 1, 2, 3), (4, 5, 6, 7)) and dealt.costs == (103.0, 96.0)
    mine = [plan.rank_micro_batches(0, r) for r in range(2)]
    assert mine == [[[0], [1], [2], [3]], [[4], [5], [6], [7]]]
    for step in range(6):  # every step: the same samples, each rank the same count
        got = [i for r in range(2) for mb in plan.rank_micro_batches(step, r) for i in mb]
        assert sorted(got) == sorted(plan.global_indices(step))
        assert [len(plan.rank_micro_batches(step, r)) for r in range(2)] == [4, 4]
        a, b = plan.assignment(step), plan.assignment(step, balanced=False)
        assert max(a.costs) <= max(b.costs)
    before, after = mean_imbalance(plan, 6)
    assert after < before
    # One rank: nothing to balance, the plain deal.
    one = _plan(12, 8, 1, 1, shuffle=False, costs=costs)
    assert not one.balanced and one.rank_micro_batches(0, 0) == [[i] for i in range(8)]


def test_data_position_refuses_another_order_naming_its_config() -> None:
    keys = {"seed": "data.seed", "global_batch": "train.global_batch_size", "held": "data.x"}
    mine = DataPosition(_plan(10, 4, 2, 2), keys, {"held": [1]})
    assert mine.state_dict() == {"seed": 3, "global_batch": 4, "held": [1]}
    mine.load_state_dict({"seed": 3, "global_batch": 4})  # a key it lacks is not checked
    other = DataPosition(_plan(10, 8, 2, 2), keys, {"held": [2]})
    with pytest.raises(CheckpointError) as err:
        mine.load_state_dict(other.state_dict())
    text = str(err.value)
    assert "global_batch=8 (this run: 4)" in text and "held=[2] (this run: [1])" in text
    assert "train.global_batch_size, data.x" in text


def _rank_step(plan: GlobalBatchPlan, step: int) -> list[list[int]]:
    return plan.rank_micro_batches(step, 1)


@pytest.mark.parametrize("workers", [0, 2])
def test_step_batches_yield_the_plans_steps_in_order_from_any_step(workers: int) -> None:
    from functools import partial

    from longboat.core.data.step_loader import step_batches

    plan = _plan(7, 4, 1, 2, deal="micro_major")
    it = step_batches(partial(_rank_step, plan), 3, num_workers=workers)
    got = [next(it) for _ in range(6)]
    assert got == [plan.rank_micro_batches(s, 1) for s in range(3, 9)]
