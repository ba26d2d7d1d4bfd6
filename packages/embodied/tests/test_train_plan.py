"""The global batch plan: world-size invariant, epoch-aware, a pure function of the step."""

from __future__ import annotations

from longboat.core.data.batch_plan import BatchLayout, GlobalBatchPlan
from longboat.embodied.train.plan import sample_plan


def _plan(n: int, gb: int, mb: int, dp: int) -> GlobalBatchPlan:
    return sample_plan(n, BatchLayout(gb, mb, dp), seed=3, shuffle=True)


def test_ranks_split_the_global_batch_like_accumulation_at_world_1() -> None:
    one = _plan(10, 4, 1, 1)  # accum 4
    two = _plan(10, 4, 1, 2)  # accum 2 per rank
    for step in range(7):  # crosses several epochs of 10 samples
        ref = [i for mb in one.rank_micro_batches(step, 0) for i in mb]
        split = [i for r in range(2) for mb in two.rank_micro_batches(step, r) for i in mb]
        assert split == ref == one.global_indices(step)


def test_every_epoch_is_a_permutation_and_epochs_differ() -> None:
    plan = _plan(10, 5, 5, 1)
    epoch0 = plan.global_indices(0) + plan.global_indices(1)
    epoch1 = plan.global_indices(2) + plan.global_indices(3)
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1


def test_a_fresh_plan_resumes_at_any_step() -> None:
    plan = _plan(13, 6, 3, 2)
    expected = [plan.global_indices(s) for s in range(9)]
    later = _plan(13, 6, 3, 2)
    assert [later.global_indices(s) for s in range(5, 9)] == expected[5:]
    state = later.state_dict(5)
    assert (state["epoch"], state["position"]) == divmod(5 * 6, 13)
