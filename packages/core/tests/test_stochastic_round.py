"""Stochastic rounding to bf16 with counter-based noise (``longboat.core.engine.torch.
stochastic_round``): unbiased, deterministic for a seed and step, exact on bf16 values."""

from __future__ import annotations

import torch

from longboat.core.engine.torch.stochastic_round import (
    PIECE,
    SEED_MIX,
    hash32,
    noise16,
    step_key,
    stochastic_round_,
)


def _round(x: torch.Tensor, seed: int, step: int, start: int = 0) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    return stochastic_round_(x, out, step_key(seed, torch.tensor(float(step))), start)


def test_mean_of_many_roundings_is_the_fp32_value() -> None:
    # 1 + 0.3 ulp and friends, each rounded at 4096 steps: the mean is within 4 standard
    # errors of the value (one bf16 ulp at 1.0 is 2**-7; the standard error of a mean of
    # n Bernoulli(p) ulps is ulp * sqrt(p (1 - p) / n) <= ulp / 128), while round-to-nearest
    # is off by up to half an ulp.
    ulp = 2.0**-7
    values = torch.tensor([1 + 0.3 * ulp, 1 + 0.01 * ulp, -(1 + 0.77 * ulp), 3e-3, -1e-30])
    runs = torch.stack([_round(values, 5, step).float() for step in range(1, 4097)])
    mean = runs.double().mean(0)
    spacing = torch.tensor([ulp, ulp, ulp, 2.0**-16, 2.0**-107], dtype=torch.float64)
    err = (mean - values.double()).abs() / spacing
    assert (err < 4 * 0.5 / 64).all(), err  # 4 sigma, sigma <= 0.5 ulp / sqrt(4096)
    nearest = (values.to(torch.bfloat16).double() - values.double()).abs() / spacing
    assert nearest[0] > 0.29 and nearest[2] > 0.22  # what round-to-nearest would be off by
    # Only the two neighbours ever come out.
    below = values.to(torch.bfloat16).float()
    assert all(len(set(runs[:, i].tolist())) == 2 for i in (0, 2, 3))
    assert (runs[:, 1] != below[1]).float().mean() < 0.03  # 1% of an ulp: rarely rounds up


def test_same_seed_step_and_index_same_rounding() -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    a, b = _round(x, 1, 7), _round(x, 1, 7)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for other in (_round(x, 2, 7), _round(x, 1, 8), _round(x, 1, 7, start=1)):
        assert not torch.equal(a.view(torch.int16), other.view(torch.int16))
    # Flat index start + i: rounding a tail alone equals the tail of the whole.
    tail = _round(x[1000:], 1, 7, start=1000)
    assert torch.equal(tail.view(torch.int16), a[1000:].view(torch.int16))


def test_bf16_values_nan_and_inf_round_to_themselves() -> None:
    x = torch.tensor([1.0, -2.5, 0.0, -0.0, float("inf"), float("-inf"), 3.0e38])
    x = x.to(torch.bfloat16).float()
    for step in range(1, 20):
        assert torch.equal(
            _round(x, 3, step).view(torch.int16), x.to(torch.bfloat16).view(torch.int16)
        )
    nan = _round(torch.tensor([float("nan"), -float("nan")]), 3, 1)
    assert nan.isnan().all() and (nan.view(torch.int16) == 0x7FC0).all()


def test_noise_is_uniform_16_bits_and_pieces_join() -> None:
    key = step_key(11, torch.tensor(3.0))
    assert key.dtype == torch.int64 and 0 <= int(key) < 2**32
    noise = noise16(key, 0, 1 << 16)
    assert int(noise.min()) >= 0 and int(noise.max()) < 1 << 16
    counts = torch.bincount(noise >> 12, minlength=16).double()  # 16 bins of 4096 expected
    assert ((counts - 4096).abs() < 5 * 64).all()
    assert int(hash32(torch.tensor([0]))) == 0 and int(hash32(torch.tensor([1]))) != 1
    base = int(hash32(torch.tensor((11 ^ SEED_MIX) & 0xFFFFFFFF)))
    assert int(key) == int(hash32(torch.tensor((base + 3) & 0xFFFFFFFF)))
    # Across a piece boundary the flat index keeps counting.
    x = torch.randn(PIECE + 5, generator=torch.Generator().manual_seed(1))
    whole = _round(x, 4, 2)
    assert torch.equal(
        whole[PIECE:].view(torch.int16), _round(x[PIECE:], 4, 2, PIECE).view(torch.int16)
    )
