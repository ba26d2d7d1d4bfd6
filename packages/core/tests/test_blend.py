"""Blended datasets: exact proportions over windows, determinism, exact resume."""

from __future__ import annotations

import numpy as np
import pytest

from longboat.core.data.blend import BlendedDataset, blend_schedule


def test_schedule_prefix_proportions_within_one() -> None:
    weights = [0.5, 0.3, 0.2]
    src = blend_schedule(weights, 10_000)
    counts = np.stack([np.cumsum(src == d) for d in range(3)], axis=1)
    n = np.arange(1, len(src) + 1)[:, None]
    err = np.abs(counts - n * np.asarray(weights))
    assert err.max() <= 1.0
    # Any window is therefore within 2 of its share; check a few explicitly.
    for start in (0, 17, 4321):
        window = src[start : start + 1000]
        np.testing.assert_allclose(np.bincount(window, minlength=3), [500, 300, 200], atol=2)


def test_zero_weight_source_is_never_drawn_and_bad_weights_fail() -> None:
    assert set(blend_schedule([1, 0, 3], 400).tolist()) == {0, 2}
    with pytest.raises(ValueError, match="weights"):
        blend_schedule([0, 0], 10)
    with pytest.raises(ValueError, match="one weight per dataset"):
        BlendedDataset([[1], [2]], [1.0])


def _sources() -> list[list[str]]:
    return [[f"a{i}" for i in range(7)], [f"b{i}" for i in range(3)], [f"c{i}" for i in range(11)]]


def test_deterministic_from_seed_and_covers_each_source_per_epoch() -> None:
    a = BlendedDataset(_sources(), [2, 1, 1], num_samples=200, seed=3)
    b = BlendedDataset(_sources(), [2, 1, 1], num_samples=200, seed=3)
    c = BlendedDataset(_sources(), [2, 1, 1], num_samples=200, seed=4)
    assert list(a) == list(b)
    assert list(a) != list(c)
    # The first len(source) draws from a source are a permutation of it (no repeats).
    first_b = [x for x in list(a) if x.startswith("b")][:3]
    assert sorted(first_b) == ["b0", "b1", "b2"]
    counts = {p: sum(x.startswith(p) for x in list(a)) for p in "abc"}
    assert counts == {"a": 100, "b": 50, "c": 50}


def test_iterator_resumes_exactly() -> None:
    full = list(BlendedDataset(_sources(), [1, 1, 2], num_samples=90, seed=7))
    ds = BlendedDataset(_sources(), [1, 1, 2], num_samples=90, seed=7)
    it = iter(ds)
    head = [next(it) for _ in range(37)]
    state = ds.state_dict()
    resumed = BlendedDataset(_sources(), [1, 1, 2], num_samples=90, seed=7)
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    with pytest.raises(ValueError, match="seed"):
        BlendedDataset(_sources(), [1, 1, 2], num_samples=90, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="weights"):
        BlendedDataset(_sources(), [1, 2, 1], num_samples=90, seed=7).load_state_dict(state)


def test_map_style_matches_iteration() -> None:
    ds = BlendedDataset(_sources(), [1, 2, 3], num_samples=50, seed=1)
    assert [ds[i] for i in range(len(ds))] == list(ds)


def test_vectorised_locate_and_lengths_match_per_sample() -> None:
    class Sized(list):
        def lengths(self) -> np.ndarray:
            return np.asarray([len(x) for x in self])

    sources = [Sized(["x" * (i + 1) for i in range(5)]), Sized(["y" * (10 + i) for i in range(4)])]
    ds = BlendedDataset(sources, [3, 1], num_samples=57, seed=2)
    src, local = ds.locate_many(np.arange(57))
    assert [ds.locate(i) for i in range(57)] == list(zip(src.tolist(), local.tolist(), strict=True))
    np.testing.assert_array_equal(ds.lengths(), [len(ds[i]) for i in range(57)])
