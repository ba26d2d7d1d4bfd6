"""The CUDA FP8 GEMM (``scaled_mm``) and FP8 linear vs the emulated ones, on the GPU.

Not collected by the default run: ``test_fp8_triton.py`` runs it in a subprocess with
``LONGBOAT_KERNEL_TEST_DEVICE=cuda``. Tolerance: ``||scaled_mm - emulated|| / ||emulated||
<= 1e-2`` on the same operands (fp32 accumulation in another order, one bf16 rounding of the
output). The ragged shapes (M = 200, 1000 tokens) check the scale layouts where a dimension
is not a multiple of 128.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("LONGBOAT_KERNEL_TEST_DEVICE", "cpu")
if DEVICE != "cuda":
    pytest.skip("scaled_mm runs on CUDA", allow_module_level=True)

from longboat.kernels.fp8 import (  # noqa: E402
    RECIPES,
    emulated_mm,
    fp8_linear,
    fp8_mm,
    quantize,
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize(
    "ga,gb", [("tensor", "tensor"), ("row", "row"), ("1x128", "128x128"), ("1x128", "1x128")]
)
@pytest.mark.parametrize(
    "mnk", [(256, 512, 384), (4096, 2048, 2048), (200, 384, 640), (1000, 5632, 2048)]
)
def test_scaled_mm_matches_emulated(ga: str, gb: str, mnk: tuple[int, int, int]) -> None:
    m, n, k = mnk
    torch.manual_seed(0)
    a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    qa, qb = quantize(a, ga), quantize(b, gb)
    got = fp8_mm(qa, qb, out_dtype=torch.bfloat16, backend="scaled_mm")
    want = emulated_mm(qa, qb, out_dtype=torch.float32)
    assert rel(got, want) <= 1e-2, f"{ga} x {gb} {mnk}: {rel(got, want):.2e}"


@pytest.mark.parametrize("seq", [250, 256])  # 1000 tokens: padded wgrad; 1024: one-pass operands
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fp8_linear_scaled_mm_matches_emulated(recipe: str, seq: int) -> None:
    torch.manual_seed(1)
    results = []
    for backend in ("scaled_mm", "emulated"):
        torch.manual_seed(1)
        x = torch.randn(4, seq, 512, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(384, 512, device=DEVICE) * 0.05).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(4, seq, 384, device=DEVICE, dtype=torch.bfloat16)
        y = fp8_linear(x, w, recipe=recipe, backend=backend)
        y.backward(dy)
        results.append((y.detach(), x.grad, w.grad))
    for got, want, what in zip(results[0], results[1], ("y", "dx", "dw"), strict=True):
        assert rel(got, want) <= 1e-2, f"{recipe} {what}: {rel(got, want):.2e}"
