"""Low-memory storage of ``adamw_master_step_``: bf16 moments and stochastically rounded bf16
weights (``sr_key=``), Triton kernel vs torch reference, and the rounding's properties.

Not collected by the default run (no ``test_`` prefix): ``test_adamw_lowmem_triton.py`` runs
this file in a subprocess, on CPU with ``TRITON_INTERPRET=1`` (set before triton is
imported) or on CUDA with ``LONGBOAT_KERNEL_TEST_DEVICE=cuda``.

The kernel and the reference compute the same fp32 update (within the fp32 kernel's 1e-6
relative bound: torch on CPU divides by a 0-d tensor as a multiply by its reciprocal) and
round it the same way; given the same noise the stochastic rounding is a function of the
fp32 value, so the bf16 weights agree bit for bit wherever the fp32 updates do.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("LONGBOAT_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 on CPU", allow_module_level=True)

from longboat import kernels as K  # noqa: E402  (after the interpreter check)
from longboat.kernels.adamw import step_key, stochastic_round_  # noqa: E402

ADAMW = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
N = 2 * 1024 + 77  # two full Triton blocks and a partial one


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, device=DEVICE)


def _buffers(seed: int, moment_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, generator=g).to(DEVICE)
    return {
        "weight": w.to(torch.bfloat16),
        "master": w.clone(),
        "grad": (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE),
        "exp_avg": (torch.randn(N, generator=g) * 0.01).to(moment_dtype).to(DEVICE),
        "exp_avg_sq": (torch.rand(N, generator=g) * 1e-3).to(moment_dtype).to(DEVICE),
    }


def _step(b: dict[str, torch.Tensor], impl: str, *, sr: bool, step: float = 3.0) -> None:
    steps = _scalar(step)
    kwargs = dict(ADAMW, lr=_scalar(1e-2), step=steps, grad_scale=_scalar(2.0),
                  found_inf=_scalar(0.0), impl=impl)  # fmt: skip
    if sr:
        key = step_key(1234, steps)
        K.adamw_master_step_(b["weight"], b["grad"], b["exp_avg"], b["exp_avg_sq"], None,
                             sr_key=key, sr_start=64, **kwargs)  # fmt: skip
    else:
        K.adamw_master_step_(b["master"], b["grad"], b["exp_avg"], b["exp_avg_sq"],
                             b["weight"], **kwargs)  # fmt: skip


def _close_bf16(a: torch.Tensor, b: torch.Tensor, max_mismatch: int) -> None:
    """bf16 buffers equal but for at most ``max_mismatch`` elements one ulp apart (an fp32
    difference of 1e-6 relative can move a rounding across its threshold)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    diff = (ia - ib).abs()
    assert int(diff.max()) <= 1
    assert int((diff != 0).sum()) <= max_mismatch


@pytest.mark.parametrize("sr", [False, True])
def test_bf16_moments_kernel_matches_reference(sr: bool) -> None:
    ref = _buffers(0, torch.bfloat16)
    tri = {k: v.clone() for k, v in ref.items()}
    for _ in range(3):
        _step(ref, "torch", sr=sr)
        _step(tri, "triton", sr=sr)
    for key in ("exp_avg", "exp_avg_sq", "weight"):
        assert tri[key].dtype == torch.bfloat16
        _close_bf16(tri[key], ref[key], max_mismatch=N // 200)
    if not sr:
        torch.testing.assert_close(tri["master"], ref["master"], rtol=1e-6, atol=1e-7)
    # The bf16 moments are the fp32 moments of one step rounded to nearest even.
    fp32 = _buffers(0, torch.bfloat16)
    fp32["exp_avg"], fp32["exp_avg_sq"] = fp32["exp_avg"].float(), fp32["exp_avg_sq"].float()
    once = _buffers(0, torch.bfloat16)
    _step(fp32, "torch", sr=False)
    _step(once, "triton", sr=False)
    _close_bf16(once["exp_avg"], fp32["exp_avg"].to(torch.bfloat16), max_mismatch=N // 200)
    _close_bf16(once["exp_avg_sq"], fp32["exp_avg_sq"].to(torch.bfloat16), N // 200)


def test_sr_kernel_rounds_like_reference_given_the_same_noise() -> None:
    # Same fp32 inputs to the rounding: one step from fp32 moments, with the update's fp32
    # result recomputed by the reference; the kernel's bf16 weight must be its stochastic
    # rounding with the noise of (seed, step, index), bit for bit where the fp32 values agree.
    tri = _buffers(1, torch.float32)
    ref = {k: v.clone() for k, v in tri.items()}
    master = ref["weight"].float()
    _step(tri, "triton", sr=True)
    steps = _scalar(3.0)
    K.adamw_master_step_(master, ref["grad"], ref["exp_avg"], ref["exp_avg_sq"], None,
                         **ADAMW, lr=_scalar(1e-2), step=steps, grad_scale=_scalar(2.0),
                         found_inf=_scalar(0.0), impl="torch")  # fmt: skip
    expect = stochastic_round_(master, torch.empty_like(tri["weight"]), step_key(1234, steps), 64)
    _close_bf16(tri["weight"], expect, max_mismatch=N // 200)
    torch.testing.assert_close(tri["exp_avg_sq"], ref["exp_avg_sq"], rtol=1e-6, atol=1e-12)
    # Exact given the exact same fp32 value: a zero update (lr 0, no decay) rounds a bf16
    # weight to itself, whatever the noise.
    w = tri["weight"].clone()
    K.adamw_master_step_(tri["weight"], tri["grad"], tri["exp_avg"], tri["exp_avg_sq"], None,
                         **{**ADAMW, "weight_decay": 0.0}, lr=_scalar(0.0), step=steps,
                         sr_key=step_key(1234, steps), impl="triton")  # fmt: skip
    assert torch.equal(tri["weight"].view(torch.int16), w.view(torch.int16))


def test_sr_skipped_step_changes_nothing() -> None:
    b = _buffers(2, torch.bfloat16)
    before = {k: v.clone() for k, v in b.items()}
    for impl in ("torch", "triton"):
        steps = _scalar(5.0)
        K.adamw_master_step_(b["weight"], b["grad"], b["exp_avg"], b["exp_avg_sq"], None,
                             **ADAMW, lr=_scalar(1e-2), step=steps, found_inf=_scalar(1.0),
                             sr_key=step_key(7, steps), impl=impl)  # fmt: skip
        for k in ("weight", "exp_avg", "exp_avg_sq"):
            assert torch.equal(b[k].view(torch.int16), before[k].view(torch.int16)), (impl, k)


def test_sr_kernel_equals_reference_bit_for_bit() -> None:
    # Zero grads and moments, lr 1, decay 0.3: both compute the fp32 value w * 0.7f exactly
    # alike (one IEEE multiply), so the stochastic roundings must agree bit for bit, and equal
    # stochastic_round_ of that value with the noise of (seed, step, sr_start + index).
    n = 4096 + 13
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE)
    zero = torch.zeros(n, device=DEVICE)
    steps = _scalar(9.0)
    key = step_key(99, steps)
    outs = {}
    for impl in ("torch", "triton"):
        w = weight.clone()
        K.adamw_master_step_(w, zero.to(torch.bfloat16), zero.clone(), zero.clone(), None,
                             beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.3,
                             lr=_scalar(1.0), step=steps, sr_key=key, sr_start=3,
                             impl=impl)  # fmt: skip
        outs[impl] = w.view(torch.int16)
    assert torch.equal(outs["torch"], outs["triton"])
    factor = torch.tensor(1.0, device=DEVICE) - torch.tensor(1.0, device=DEVICE) * 0.3
    x = weight.float() * factor
    expect = stochastic_round_(x, torch.empty_like(weight), key, 3)
    assert torch.equal(outs["triton"], expect.view(torch.int16))
    # Not round-to-nearest: the noise moves a share of the values up one ulp.
    nearest = x.to(torch.bfloat16).view(torch.int16)
    assert 0.2 < (outs["triton"] != nearest).float().mean() < 0.8
