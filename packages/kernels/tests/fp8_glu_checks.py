"""The SwiGLU fused into the FP8 down projection vs the unfused pair.

Not collected by the default run: ``test_fp8_triton.py`` runs it in a subprocess, on CPU with
``TRITON_INTERPRET=1`` or on CUDA with ``LONGBOAT_KERNEL_TEST_DEVICE=cuda``.

Expectations, bit for bit:
- ``glu_quantize_dual(h)``: the codes and scales of the torch reference quantiser
  (``quantize_torch``) applied to the unfused GLU kernel's output ``a`` and to ``a^T``;
- ``fp8_glu_linear``: the output and the gradients of ``h``, ``W`` and the bias of
  ``fp8_linear(glu(h), W, b)`` (the unfused path), the weight gradient also through a hook.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("LONGBOAT_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 on CPU", allow_module_level=True)

from longboat.kernels.fp8 import E4M3, E5M2, fp8_linear, quantize_torch  # noqa: E402
from longboat.kernels.fp8.glu_linear import fp8_glu_linear, fused_applies  # noqa: E402
from longboat.kernels.fp8.glu_quant import glu_quantize_dual  # noqa: E402
from longboat.kernels.fp8.layer_linear import fp8_glu_linear_fn  # noqa: E402
from longboat.kernels.fp8.linear import get_recipe  # noqa: E402
from longboat.kernels.swiglu import glu  # noqa: E402

BACKEND = "scaled_mm" if DEVICE == "cuda" else "emulated"


def _same_operand(got, want) -> None:  # type: ignore[no-untyped-def]
    assert got.granularity == want.granularity
    assert got.scale.shape == want.scale.shape and got.scale.stride() == want.scale.stride()
    assert torch.equal(got.scale, want.scale), "scales differ"
    assert got.data.dtype == want.data.dtype and got.data.is_contiguous()
    a, b = got.data.float(), want.data.float()
    assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} codes differ"


def _packed(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-3, 3, (*shape[:-1], 1), generator=g).float())
    return (torch.randn(*shape, generator=g) * 2 * spread).to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(1, 260), (37, 256), (130, 600), (3, 50, 384)])
def test_fused_operands_equal_the_reference_quantiser_of_the_glu(shape, dtype, activation) -> None:  # type: ignore[no-untyped-def]
    h = _packed(shape, sum(shape))
    got, got_t = glu_quantize_dual(h, activation, dtype, impl="triton")
    a = glu(h, activation=activation, impl="triton")  # the unfused kernel's bf16 output
    a2 = a.reshape(-1, a.shape[-1])
    _same_operand(got, quantize_torch(a2, "1x128", dtype))
    _same_operand(got_t, quantize_torch(a2.t(), "1x128", dtype))


def test_warps_do_not_change_the_operands() -> None:
    h = _packed((130, 600), 4)
    a = glu(h, impl="triton").reshape(-1, 300)
    for warps in (8, 16):
        got, got_t = glu_quantize_dual(h, impl="triton", num_warps=warps)
        _same_operand(got, quantize_torch(a, "1x128", E4M3))
        _same_operand(got_t, quantize_torch(a.t(), "1x128", E4M3))


def test_torch_path_is_the_unfused_composition() -> None:
    h = _packed((130, 600), 3)
    got, got_t = glu_quantize_dual(h, impl="torch")
    a = glu(h, impl="torch")
    _same_operand(got, quantize_torch(a, "1x128", E4M3))
    _same_operand(got_t, quantize_torch(a.t(), "1x128", E4M3))


def test_custom_op_fake_matches_the_kernel() -> None:
    for h in (_packed((130, 600), 5), _packed((2, 65, 256), 6)):
        torch.library.opcheck(
            torch.ops.longboat.fp8_glu_quantize_dual.default, (h, 0, E4M3, 16),
            test_utils=("test_schema", "test_faketensor"),
        )  # fmt: skip


def _run(fn, h, w, b, hook_buf=None):  # type: ignore[no-untyped-def]
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    b = None if b is None else b.detach().clone().requires_grad_(True)
    kw = {}
    if hook_buf is not None:

        def hook(dw: torch.Tensor) -> None:
            hook_buf.add_(dw)

        kw = {"wgrad_hook": hook, "wgrad_dtype": torch.float32}
    y = fn(h, w, b, **kw)
    g = torch.Generator().manual_seed(11)
    dy = torch.randn(y.shape, generator=g).to(DEVICE, y.dtype)
    y.backward(dy)
    return y, h.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(256, 512, 384), (2, 64, 768, 128)])
def test_fused_linear_equals_the_unfused_pair(shape, bias) -> None:  # type: ignore[no-untyped-def]
    *lead, two_c, n = shape
    h = _packed((*lead, two_c), 21)
    g = torch.Generator().manual_seed(22)
    w = (torch.randn(n, two_c // 2, generator=g) * 0.05).to(DEVICE, torch.bfloat16)
    b = (torch.randn(n, generator=g)).to(DEVICE, torch.bfloat16) if bias else None
    recipe = get_recipe("blockwise")
    assert fused_applies(h, w.requires_grad_(True), recipe, BACKEND, impl="triton")

    def fused(h, w, b, **kw):  # type: ignore[no-untyped-def]
        return fp8_glu_linear(h, w, b, backend=BACKEND, impl="triton", **kw)

    def unfused(h, w, b, **kw):  # type: ignore[no-untyped-def]
        return fp8_linear(glu(h, impl="triton"), w, b, backend=BACKEND, **kw)

    for got, want in zip(_run(fused, h, w, b), _run(unfused, h, w, b), strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.dtype == want.dtype and torch.equal(got, want)
    buf_fused = torch.zeros(w.shape, device=DEVICE, dtype=torch.float32)
    buf_unfused = torch.zeros_like(buf_fused)
    got = _run(fused, h, w, b, buf_fused)
    want = _run(unfused, h, w, b, buf_unfused)
    assert torch.equal(buf_fused, buf_unfused) and buf_fused.abs().sum() > 0
    assert got[2] is None and want[2] is None  # the hook took the weight gradient
    assert torch.equal(got[1], want[1])


def test_fallbacks_run_the_unfused_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    h = _packed((128, 512), 31)
    w = (torch.randn(128, 256) * 0.05).to(DEVICE, torch.bfloat16)
    blockwise = get_recipe("blockwise")
    with monkeypatch.context() as env:
        env.setenv("LONGBOAT_FP8_FUSE_GLU", "0")
        assert not fused_applies(h, w.clone().requires_grad_(True), blockwise, BACKEND, impl="triton")  # fmt: skip
    assert not fused_applies(h, w, blockwise, BACKEND, impl="triton")  # frozen weight
    assert not fused_applies(h, w.requires_grad_(True), get_recipe("rowwise"), BACKEND, impl="triton")  # fmt: skip
    assert not fused_applies(h, w, blockwise, BACKEND, impl="torch")
    if BACKEND == "scaled_mm":  # cuBLAS: tokens not a multiple of 16
        assert not fused_applies(h[:100], w, blockwise, BACKEND, impl="triton")
    with torch.no_grad():
        assert not fused_applies(h, w, blockwise, BACKEND, impl="triton")
        got = fp8_glu_linear(h, w, backend=BACKEND, impl="triton")
    want = fp8_linear(glu(h, impl="triton"), w.detach(), backend=BACKEND)
    assert torch.equal(got, want)
    for recipe in ("rowwise", "tensorwise"):
        got = fp8_glu_linear(h, w, recipe=recipe, backend=BACKEND, impl="triton")
        want = fp8_linear(glu(h, impl="triton"), w, recipe=recipe, backend=BACKEND)
        assert torch.equal(got, want)


def test_layer_function_is_fused_for_blockwise_only() -> None:
    assert fp8_glu_linear_fn("blockwise") is not None
    assert fp8_glu_linear_fn("rowwise") is None and fp8_glu_linear_fn("adaptive") is None
    with pytest.raises(ValueError, match="recipe 'nope'"):
        fp8_glu_linear_fn("nope")


def test_bad_inputs_are_refused() -> None:
    w = torch.zeros(128, 256, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2 x the weight's in-features"):
        fp8_glu_linear(torch.zeros(4, 256, device=DEVICE, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="even last dim"):
        glu_quantize_dual(torch.zeros(4, 255, device=DEVICE, dtype=torch.bfloat16))
