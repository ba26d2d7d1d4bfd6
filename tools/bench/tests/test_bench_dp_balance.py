"""The DP balancing simulation: a few steps, balanced is more even than plain sharding."""

from __future__ import annotations

import dp_balance


def test_simulation_balances_within_the_cap() -> None:
    row = dp_balance.simulate(dp=8, per_rank=8, steps=5, seed=1)
    assert row["before_mean"] > 1.1
    assert row["after_mean"] < row["before_mean"]
    assert row["after_mean"] < 1.02
    assert row["max_tokens_over_mean"] <= 1.2 + 1e-9


def test_sample_mix_has_every_kind() -> None:
    import numpy as np

    mix = dp_balance.draw_samples(np.random.default_rng(0), 400)
    assert {s["kind"] for s in mix} == {"text", "image", "multi", "video"}
    tokens = [dp_balance.sample_cost(s)[1] for s in mix]
    assert max(tokens) / min(tokens) > 50  # the spread that makes balancing matter
