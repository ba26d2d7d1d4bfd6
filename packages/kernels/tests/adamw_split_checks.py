"""Split master storage of ``adamw_master_step_`` (``master_lo=``): Triton kernel vs torch
reference vs the fp32-master update.

Not collected by the default run (no ``test_`` prefix): ``test_adamw_split_triton.py`` runs
this file in a subprocess, on CPU with ``TRITON_INTERPRET=1`` (set before triton is
imported) or on CUDA with ``LONGBOAT_KERNEL_TEST_DEVICE=cuda``.

Exactness, not tolerances: the split storage holds the fp32 master exactly, so the split
kernel's masters and moments must equal the fp32-master kernel's bit for bit (same
implementation, same inputs), and the split reference's the fp32 reference's. Triton vs
the torch reference keeps the fp32 kernel's bound (1e-6 relative: torch on CPU divides by
a 0-d tensor as a multiply by its reciprocal).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

DEVICE = os.environ.get("LONGBOAT_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 on CPU", allow_module_level=True)

from longboat import kernels as K  # noqa: E402  (after the interpreter check)
from longboat.kernels.adamw import join_fp32_, split_fp32_  # noqa: E402

ADAMW = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
N = 3 * 1024 + 77  # three full Triton blocks and a partial one
TIES = [1.00390625, -1.00390625, 1.01171875, -1.01171875, 3.0078125, -3.0078125]


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, device=DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _from_bits(values: list[int]) -> torch.Tensor:
    signed = [v - (1 << 32) if v >= 1 << 31 else v for v in values]
    return torch.tensor(signed, dtype=torch.int32, device=DEVICE).view(torch.float32)


# Edge values: ties, +-0, fp32 and bf16 subnormals, +-inf, the largest finite values (which
# round to inf in bf16), values whose rounding crosses a binade (0x3F7FFFFF -> 1.0), lows of
# +-32767 / -32768 and a quiet NaN.
SPECIAL_BITS = [
    0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00008000, 0x80008000, 0x007FFFFF,
    0x807FFFFF, 0x00800000, 0x3F7FFFFF, 0xBF7FFFFF, 0x3F7F8000, 0x3F807FFF, 0x3F808000,
    0xBF808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F800000,
    0xFF800000, 0x7FC00000,
]  # fmt: skip


def _special_values() -> torch.Tensor:
    return torch.cat([_from_bits(SPECIAL_BITS), torch.tensor(TIES, device=DEVICE)])


def _states(n: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The same start as fp32 storage (master, param_out) and split storage (hi, lo)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    master = torch.randn(n, device=DEVICE, generator=g)
    master[: len(TIES)] = torch.tensor(TIES, device=DEVICE)
    fp32 = {
        "master": master.clone(),
        "exp_avg": torch.zeros(n, device=DEVICE),
        "exp_avg_sq": torch.zeros(n, device=DEVICE),
        "param_out": master.bfloat16(),
    }
    hi = torch.empty(n, device=DEVICE, dtype=torch.bfloat16)
    lo = torch.empty(n, device=DEVICE, dtype=torch.int16)
    split_fp32_(master, hi, lo)
    split = {
        "hi": hi,
        "lo": lo,
        "exp_avg": fp32["exp_avg"].clone(),
        "exp_avg_sq": fp32["exp_avg_sq"].clone(),
    }
    return fp32, split


def _fp32_call(state, grad, impl, **scalars) -> None:  # type: ignore[no-untyped-def]
    K.adamw_master_step_(
        state["master"], grad, state["exp_avg"], state["exp_avg_sq"], state["param_out"],
        **ADAMW, **scalars, impl=impl,
    )  # fmt: skip


def _split_call(state, grad, impl, **scalars) -> None:  # type: ignore[no-untyped-def]
    K.adamw_master_step_(
        state["hi"], grad, state["exp_avg"], state["exp_avg_sq"], None,
        **ADAMW, **scalars, master_lo=state["lo"], impl=impl,
    )  # fmt: skip


def _assert_split_of(state: dict[str, torch.Tensor], master: torch.Tensor, what: str) -> None:
    """``state``'s hi / lo are the split of ``master``: joined bit for bit, hi its bf16
    rounding (ties away from zero, else torch's to nearest even)."""
    joined = join_fp32_(state["hi"], state["lo"])
    assert torch.equal(_bits(joined), _bits(master)), f"{what}: joined master differs"
    rne = master.bfloat16()
    ties = (_bits(master) & 0xFFFF) == 0x8000
    off = ~ties & ~torch.isnan(master)
    assert torch.equal(_bits(state["hi"])[off], _bits(rne)[off]), f"{what}: hi off ties"
    assert (state["hi"][ties].float().abs() > master[ties].abs()).all(), f"{what}: ties"


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", [None, 4.0])
def test_split_kernel_equals_the_fp32_master_update(grad_dtype, clip) -> None:  # type: ignore[no-untyped-def]
    """3 steps with a per-step lr (and a clip factor): split Triton == fp32 Triton and split
    reference == fp32 reference, masters and moments bit for bit; Triton vs reference
    within 1e-6 relative; hi / lo always the split of the masters."""
    runs = {}
    for impl in ("triton", "torch"):
        runs[impl] = _states(N, 0)
    lr, step = _scalar(0.0), _scalar(0.0)
    grad_scale = None if clip is None else _scalar(clip)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    init = runs["torch"][0]["master"].clone()
    for i in range(3):
        grad = torch.randn(N, device=DEVICE, generator=g).to(grad_dtype)
        lr.fill_(1e-2 * (i + 1))
        step.add_(1.0)
        for impl, (fp32, split) in runs.items():
            _fp32_call(fp32, grad, impl, lr=lr, step=step, grad_scale=grad_scale)
            _split_call(split, grad, impl, lr=lr, step=step, grad_scale=grad_scale)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(_bits(split[key]), _bits(fp32[key])), f"{impl} {i}: {key}"
            _assert_split_of(split, fp32["master"], f"{impl} step {i + 1}")
        tri, ref = runs["triton"][0]["master"], runs["torch"][0]["master"]
        err = ((tri - ref).double().norm() / ref.double().norm()).item()
        assert err <= 1e-6, f"step {i + 1}: triton vs reference master {err:.2e}"
    assert (runs["triton"][0]["master"] - init).abs().max() > 1e-2  # the masters moved


def test_split_kernel_keeps_edge_values_exactly() -> None:
    """lr 0, no decay, zero grads: the update keeps every master; hi / lo after the kernel
    are the exact split (the edge values above), a NaN stays the canonical NaN."""
    values = _special_values()
    n = values.numel()
    for impl in ("triton", "torch"):
        hi = torch.empty(n, device=DEVICE, dtype=torch.bfloat16)
        lo = torch.empty(n, device=DEVICE, dtype=torch.int16)
        split_fp32_(values, hi, lo)
        state = {"hi": hi, "lo": lo, "exp_avg": torch.zeros(n, device=DEVICE),
                 "exp_avg_sq": torch.zeros(n, device=DEVICE)}  # fmt: skip
        grad = torch.zeros(n, device=DEVICE, dtype=torch.bfloat16)
        K.adamw_master_step_(
            state["hi"], grad, state["exp_avg"], state["exp_avg_sq"], None,
            lr=_scalar(0.0), beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
            step=_scalar(1.0), master_lo=state["lo"], impl=impl,
        )  # fmt: skip
        nan = torch.isnan(values)
        joined = join_fp32_(state["hi"], state["lo"])
        assert torch.equal(_bits(joined)[~nan], _bits(values)[~nan]), impl
        assert torch.isnan(joined[nan]).all() and (_bits(state["hi"])[nan] == 0x7FC0).all()
        assert (state["lo"][nan] == 0).all()
        _assert_split_of(state, joined, impl)
        # lo covers the whole int16 range, hi the overflow to +-inf of the largest values.
        assert int(state["lo"].min()) == -32768 and int(state["lo"].max()) == 32767
        big = torch.isfinite(values) & ((_bits(values) & 0x7FFFFFFF) >= 0x7F7F8000)
        assert int(big.sum()) == 3 and torch.isinf(state["hi"][big]).all()


def test_split_helpers_round_trip_random_bits() -> None:
    """Every finite / infinite fp32 bit pattern class: split then join is the identity."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (50_000,), device=DEVICE, generator=g)
    x = bits.to(torch.int32).view(torch.float32)
    x = x[~torch.isnan(x)]
    hi = torch.empty(x.numel(), device=DEVICE, dtype=torch.bfloat16)
    lo = torch.empty(x.numel(), device=DEVICE, dtype=torch.int16)
    split_fp32_(x, hi, lo)
    assert torch.equal(_bits(join_fp32_(hi, lo)), _bits(x))
    _assert_split_of({"hi": hi, "lo": lo}, x, "random bits")


def test_split_kernel_found_inf_changes_nothing(skipped_step_check: Callable[..., None]) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(2)
    for impl in ("triton", "torch"):
        _, state = _states(N, 3)
        good = torch.randn(N, device=DEVICE, generator=g).bfloat16()
        skipped_step_check(_split_call, state, good, impl, updated="lo")


def test_split_kernel_custom_op_schema() -> None:
    from torch.library import opcheck

    _, state = _states(100, 5)
    args = (
        state["hi"], state["lo"], torch.randn(100, device=DEVICE).bfloat16(),
        state["exp_avg"], state["exp_avg_sq"], _scalar(1e-3), _scalar(1.0), _scalar(2.0),
        _scalar(0.0), 0.9, 0.999, 1e-8, 0.1,
    )  # fmt: skip
    opcheck(
        torch.ops.longboat.adamw_split_master_step,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )


def test_split_kernel_rejects_bad_buffers() -> None:
    fp32, split = _states(10, 6)
    grad = torch.zeros(10, device=DEVICE, dtype=torch.bfloat16)
    scalars = {"lr": _scalar(1.0), "step": _scalar(1.0)}
    with pytest.raises(ValueError, match="needs master = the bf16 weights and master_lo int16"):
        K.adamw_master_step_(fp32["master"], grad, fp32["exp_avg"], fp32["exp_avg_sq"], None,
                             **ADAMW, **scalars, master_lo=split["lo"])  # fmt: skip
    with pytest.raises(ValueError, match="pass param_out=None"):
        K.adamw_master_step_(split["hi"], grad, split["exp_avg"], split["exp_avg_sq"],
                             fp32["param_out"], **ADAMW, **scalars, master_lo=split["lo"])  # fmt: skip
    with pytest.raises(ValueError, match="master_lo must be a contiguous 1-D tensor"):
        _split_call({**split, "lo": split["lo"][:9]}, grad, "torch", **scalars)


if DEVICE == "cuda":  # defined only where it can run: a skip would fail the CPU run's check

    def test_split_kernel_replays_in_a_cuda_graph(graph_replay_check: Callable[..., None]) -> None:
        """Captured once, replayed with new lr / step / found_inf: bit for bit the eager
        split kernel with the same values."""
        _, graphed = _states(N, 7)
        _, eager = _states(N, 7)
        grad = torch.randn(N, device=DEVICE).bfloat16()
        graph_replay_check(_split_call, graphed, eager, grad)
