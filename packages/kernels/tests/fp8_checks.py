"""Triton FP8 quantisation vs the torch reference.

Not collected by the default run: ``test_fp8_triton.py`` runs it in a subprocess, on CPU with
``TRITON_INTERPRET=1`` (set before triton is imported) or on CUDA with
``LONGBOAT_KERNEL_TEST_DEVICE=cuda``. Shapes are small and ragged (dims not multiples of 128,
one row, transposed views).

Expectations: scales and FP8 codes equal the reference's bit for bit (the same amax, one
fp32 division, round to nearest even).
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("LONGBOAT_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 on CPU", allow_module_level=True)

from longboat.kernels.fp8 import (  # noqa: E402  (after the interpreter check)
    E4M3,
    E5M2,
    quantize,
    quantize_torch,
)
from longboat.kernels.fp8.quantize import (  # noqa: E402
    quantize_blocks_transposed,
    quantize_dual,
)

SHAPES = [(1, 130), (37, 128), (130, 300), (256, 64)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("granularity", ["tensor", "row", "1x128", "128x128"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_quantize_matches_reference(shape, granularity, dtype, transposed) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(sum(shape))
    base = torch.randn(*shape, device=DEVICE) * torch.exp2(
        torch.randint(-3, 3, (shape[0], 1), device=DEVICE).float()
    )
    x = base.to(torch.bfloat16)
    x = x.t() if transposed else x  # a strided view, read in place
    got = quantize(x, granularity, dtype, impl="triton")
    want = quantize_torch(x, granularity, dtype)
    assert got.scale.shape == want.scale.shape and got.scale.stride() == want.scale.stride()
    assert torch.equal(got.scale, want.scale), f"scales differ by {rel(got.scale, want.scale):.2e}"
    assert got.data.dtype == dtype and got.data.is_contiguous()
    a, b = got.data.float(), want.data.float()
    assert torch.equal(a, b), f"{int((a != b).sum())} codes differ"


def test_zero_tiles_quantise_to_zero() -> None:
    x = torch.zeros(3, 256, device=DEVICE, dtype=torch.bfloat16)
    x[0, :128] = 2.0
    got = quantize(x, "1x128", impl="triton")
    assert torch.equal(got.dequantize(), x.float())


def test_custom_op_fake_matches_the_kernel() -> None:
    """``torch.ops.longboat.fp8_quantize`` (what torch.compile traces): schema and fake
    implementation agree with the kernel on shapes, strides and dtypes."""
    x = torch.randn(130, 300, device=DEVICE, dtype=torch.bfloat16)
    for granularity in ("tensor", "row", "1x128", "128x128"):
        for view in (x, x.t()):
            torch.library.opcheck(
                torch.ops.longboat.fp8_quantize.default, (view, granularity, E4M3),
                test_utils=("test_schema", "test_faketensor"),
            )  # fmt: skip


def _same(got, want) -> None:  # type: ignore[no-untyped-def]
    assert got.scale.shape == want.scale.shape and got.scale.stride() == want.scale.stride()
    assert torch.equal(got.scale, want.scale), f"scales differ by {rel(got.scale, want.scale):.2e}"
    assert got.data.dtype == want.data.dtype and got.data.is_contiguous()
    a, b = got.data.float(), want.data.float()
    assert torch.equal(a, b), f"{int((a != b).sum())} codes differ"


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [*SHAPES, (300, 130)])
@pytest.mark.parametrize("transposed", [False, True])
def test_dual_and_transposed_blocks_match_reference(shape, dtype, transposed) -> None:  # type: ignore[no-untyped-def]
    """One read, two 1x128 operands (x along K, x^T along the rows), and W^T's 128x128
    operand written transposed: bit for bit the single quantisations of x and x.t()."""
    torch.manual_seed(7 + sum(shape))
    scale_rows = torch.exp2(torch.randint(-3, 3, (shape[0], 1), device=DEVICE).float())
    x = (torch.randn(*shape, device=DEVICE) * scale_rows).to(torch.bfloat16)
    x = x.t() if transposed else x
    got, got_t = quantize_dual(x, dtype, impl="triton")
    _same(got, quantize_torch(x, "1x128", dtype))
    _same(got_t, quantize_torch(x.t(), "1x128", dtype))
    _same(
        quantize_blocks_transposed(x, dtype, impl="triton"), quantize_torch(x.t(), "128x128", dtype)
    )


def test_dual_custom_ops_fakes_match_the_kernels() -> None:
    x = torch.randn(130, 300, device=DEVICE, dtype=torch.bfloat16)
    for view in (x, x.t()):
        for name in ("fp8_quantize_dual", "fp8_quantize_blocks_t"):
            torch.library.opcheck(
                getattr(torch.ops.longboat, name).default, (view, E4M3),
                test_utils=("test_schema", "test_faketensor"),
            )  # fmt: skip
