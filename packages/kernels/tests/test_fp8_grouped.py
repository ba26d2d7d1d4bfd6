"""FP8 GEMMs of MoE experts (``fp8_grouped_linear``) against an fp64 per-expert reference.

Tolerances, as ``||fp8 - ref|| / ||ref||`` on Gaussian inputs (the FP8 linear's, test_fp8.py):
forward 0.04, input and weight gradients 0.05 with e4m3 gradients and 0.08 with e5m2
(tensorwise). Measured on the shapes below: forward 3.6%, gradients 3.0-3.6% (e4m3), 6.0%
(e5m2). The emulated ``grouped`` backend (rowwise scales laid out for the grouped kernel,
contraction groups padded to 16 tokens) equals the ``looped`` one to fp32 rounding (1e-5).
"""

from __future__ import annotations

import pytest
import torch

from longboat.kernels.fp8.grouped import (
    fp8_grouped_linear,
    high_precision_grouped_linear,
    resolve_grouped_backend,
)
from longboat.kernels.fp8.linear import get_recipe

TOLS = {"blockwise": (0.04, 0.05), "rowwise": (0.04, 0.05), "tensorwise": (0.04, 0.08)}
CASES = [("blockwise", "looped"), ("rowwise", "looped"), ("rowwise", "grouped"),
         ("tensorwise", "looped")]  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def problem(counts: list[int], n: int = 48, k: int = 160, device: str = "cpu", seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    t = sum(counts)
    x = torch.randn(t, k, generator=g)
    w = torch.randn(len(counts), n, k, generator=g) * k**-0.5
    dy = torch.randn(t, n, generator=g)
    return x.to(device), w.to(device), dy.to(device), torch.tensor(counts, device=device)


def reference(x, w, dy, counts):  # type: ignore[no-untyped-def]
    """fp64 per-expert products and their gradients."""
    xr = x.double().requires_grad_()
    wr = w.double().requires_grad_()
    parts = torch.split(xr, counts.tolist())
    y = torch.cat([p @ we.t() for p, we in zip(parts, wr, strict=True)])
    y.backward(dy.double())
    return y.detach(), xr.grad, wr.grad


def run(x, w, dy, counts, recipe, backend, dtype=torch.float32):  # type: ignore[no-untyped-def]
    xr = x.to(dtype).requires_grad_()
    wr = w.to(dtype).requires_grad_()
    y = fp8_grouped_linear(xr, wr, counts, recipe=recipe, backend=backend)
    y.backward(dy.to(dtype))
    return y.detach(), xr.grad, wr.grad


@pytest.mark.parametrize("recipe,backend", CASES)
def test_grouped_fp8_matches_reference(recipe: str, backend: str) -> None:
    """Forward, input and weight gradients within the stated tolerances; an expert with no
    tokens gets a zero weight gradient; K (160) is not a multiple of 128."""
    x, w, dy, counts = problem([5, 0, 150, 9])
    ref = reference(x, w, dy, counts)
    y, dx, dw = run(x, w, dy, counts, recipe, backend)
    fwd, grad = TOLS[recipe]
    assert rel(y, ref[0]) <= fwd
    assert rel(dx, ref[1]) <= grad
    assert rel(dw, ref[2]) <= grad
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))
    assert rel(y, ref[0]) > 1e-4  # the FP8 rounding happened


def test_grouped_backend_equals_looped_rowwise() -> None:
    """The grouped layout (row scales per expert, per-(expert, column) scales of the weight
    gradient's operands, groups padded to 16 tokens) gives the looped products."""
    x, w, dy, counts = problem([3, 40, 0, 17, 1])
    a = run(x, w, dy, counts, "rowwise", "looped")
    b = run(x, w, dy, counts, "rowwise", "grouped")
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe,backend", CASES)
def test_scales_are_per_expert(recipe: str, backend: str) -> None:
    """Expert 0's rows and weights 1e4 times larger leave the other experts' error as it was:
    no scale is shared across experts (a shared tensorwise scale would flush them to zero)."""
    x, w, dy, counts = problem([32, 32, 32])
    x[:32] *= 1e4
    w[0] *= 1e4
    dy[:32] *= 1e4
    ref = reference(x, w, dy, counts)
    out = run(x, w, dy, counts, recipe, backend)
    fwd, grad = TOLS[recipe]
    rest = slice(32, None)
    assert rel(out[0][rest], ref[0][rest]) <= fwd
    assert rel(out[1][rest], ref[1][rest]) <= grad
    assert rel(out[2][1:], ref[2][1:]) <= grad


def test_backend_resolution() -> None:
    assert resolve_grouped_backend(None, get_recipe("rowwise")) == "grouped"
    assert resolve_grouped_backend(None, get_recipe("blockwise")) == "looped"
    assert resolve_grouped_backend("looped", get_recipe("rowwise")) == "looped"
    with pytest.raises(ValueError, match="rowwise recipe"):
        resolve_grouped_backend("grouped", get_recipe("tensorwise"))
    with pytest.raises(ValueError, match="expected one of"):
        resolve_grouped_backend("fast", get_recipe("rowwise"))


def test_high_precision_grouped_is_exact() -> None:
    x, w, _, counts = problem([7, 0, 25])
    parts = torch.split(x, counts.tolist())
    want = torch.cat([p @ we.t() for p, we in zip(parts, w, strict=True)])
    torch.testing.assert_close(high_precision_grouped_linear(x, w, counts), want)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs an sm90 GPU",
)
@pytest.mark.parametrize("recipe,backend", CASES)
def test_grouped_fp8_on_gpu(recipe: str, backend: str) -> None:
    """cuBLAS / CUTLASS FP8 GEMMs (``scaled_mm`` per expert, ``scaled_grouped_mm``) against
    the same fp64 reference, bf16 operands, uneven groups (one empty, one not a multiple of
    16 tokens)."""
    x, w, dy, counts = problem([5, 0, 300, 77], n=256, k=384, device="cuda")
    ref = reference(x, w, dy, counts)
    y, dx, dw = run(x, w, dy, counts, recipe, backend, dtype=torch.bfloat16)
    fwd, grad = TOLS[recipe]
    assert rel(y, ref[0]) <= fwd + 0.01  # + the bf16 rounding of the operands and outputs
    assert rel(dx, ref[1]) <= grad + 0.01
    assert rel(dw, ref[2]) <= grad + 0.01
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))


def test_layer_kernels_carry_the_grouped_fp8_function() -> None:
    """``longboat_layer_kernels(fp8=...)`` gives the MoE experts their FP8 function: the looped
    recipes say they read the counts on the host (no CUDA graph), rowwise does not, adaptive
    shares the dense linears' chooser; the function is ``fp8_grouped_linear`` of its recipe."""
    from longboat.kernels.fp8.layer_linear import AdaptiveGroupedLinear, fp8_grouped_linear_fn
    from longboat.kernels.layers import longboat_layer_kernels

    assert longboat_layer_kernels().grouped_linear is None
    assert longboat_layer_kernels(fp8="blockwise").grouped_linear.waits_for_host
    assert not longboat_layer_kernels(fp8="rowwise").grouped_linear.waits_for_host
    adaptive = longboat_layer_kernels(fp8="adaptive")
    assert isinstance(adaptive.grouped_linear, AdaptiveGroupedLinear)
    assert adaptive.grouped_linear.dense is adaptive.linear
    with pytest.raises(ValueError, match="expected one of"):
        fp8_grouped_linear_fn("delayed")
    x, w, _, counts = problem([4, 12])
    fn = fp8_grouped_linear_fn("tensorwise")
    assert torch.equal(fn(x, w, counts), fp8_grouped_linear(x, w, counts, recipe="tensorwise"))
