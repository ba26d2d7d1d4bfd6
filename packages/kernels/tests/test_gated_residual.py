"""Gated residual (``x + y * gate``): Triton vs the torch reference, forward and backward.

One file, two roles. The default run collects the shape-error tests and
``TestKernelChecksRun``, which runs this same file in a subprocess (``run_checks`` in
conftest.py): on CPU with ``TRITON_INTERPRET=1`` (set before triton is imported), on CUDA
(``-m gpu``) with the compiled kernels. That subprocess sets ``LONGBOAT_KERNEL_TEST_DEVICE``
and collects ``TestGatedResidualKernel`` instead.

Tolerances, elementwise against autograd through ``gated_residual_torch`` on the same
inputs, ``u`` the relative rounding step of the result's dtype (fp32 0, fp16 2**-10, bf16
2**-7): ``out``: ``u * |ref| + 2**-20 * (|x| + |y * gate|)`` (one rounding of the same fp32
value, which the interpreter does toward zero where torch rounds to nearest, plus a fused
multiply-add on CUDA); ``dy``: ``u * |ref|`` (one product, one rounding); ``dgate``:
``u * |ref| + 1e-5 * sum_s |dout * y|`` (fp32 sums in another order); ``dx`` bit for bit.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from longboat import kernels as K

DEVICE = os.environ.get("LONGBOAT_KERNEL_TEST_DEVICE", "")
KERNELS_RUN = DEVICE == "cuda" or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ULP = {F32: 0.0, F16: 2.0**-10, BF16: 2.0**-7}
# (x / y dtype, gate dtype)
DTYPES = [(F32, F32), (F32, BF16), (BF16, F32), (BF16, BF16)]
# (batch, seq, hidden): one token tile; several token tiles and backward steps with a partial
# last one; a partial channel block (96, and 640 in the forward); hidden never a power of two.
SHAPES = [(b, s, d) for b in (1, 2) for s, d in ((37, 48), (150, 96), (70, 640))]
# On CUDA also DiT-sized ones: Wan 1.3B's hidden, FLUX's 3072, 100k tokens.
LARGE = [(2, 4133, 3072), (1, 100_003, 1536)] if DEVICE == "cuda" else []


def test_rejects_bad_shapes() -> None:
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, hidden\], got shape \(5, 8\)"):
        K.gated_residual(x[0], x[0], torch.randn(2, 8))
    with pytest.raises(ValueError, match=r"y shape \(2, 4, 8\) must equal x shape \(2, 5, 8\)"):
        K.gated_residual(x, x[:, :4], torch.randn(2, 8))
    for bad in ((2, 9), (1, 8), (2, 2, 8), (8,)):
        with pytest.raises(ValueError, match=re.escape(f"gate shape {bad} must be (2, 8) or")):
            K.gated_residual(x, x, torch.randn(*bad))
    with pytest.raises(ValueError, match="gate must be floating point"):
        K.gated_residual(x, x, torch.ones(2, 8, dtype=torch.int64))


class TestKernelChecksRun:
    """Runs ``TestGatedResidualKernel`` in a subprocess (not collected inside it)."""

    __test__ = not KERNELS_RUN

    def test_kernels_match_reference_in_interpreter(
        self, run_checks: Callable[[str, str], None]
    ) -> None:
        run_checks(Path(__file__).name, "cpu")

    @pytest.mark.gpu
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    def test_kernels_match_reference_on_gpu(self, run_checks: Callable[[str, str], None]) -> None:
        run_checks(Path(__file__).name, "cuda")


def _leaf(shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype).requires_grad_()


def _run(impl: str, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, seed: int = 11):
    """Forward, then the gradients of a random projection of the output."""
    out = K.gated_residual(x, y, gate, impl=impl)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    proj = torch.randn(out.shape, device=DEVICE, generator=gen)
    wanted = [t for t in (x, y, gate) if t.requires_grad]
    grads = torch.autograd.grad((out.float() * proj).sum(), wanted)
    return out.detach(), dict(zip([id(t) for t in wanted], grads, strict=True))


def _assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape, (what, got.dtype, got.shape)
    assert torch.isfinite(got).all(), f"{what}: not finite"
    err = (got.double() - ref.double()).abs()
    worst = (err - bound.double()).max().item() if err.numel() else 0.0
    assert worst <= 0.0, f"{what}: max err {err.max().item():.3e} exceeds its bound"


def _check_against_reference(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, what: str):
    """Triton vs reference values and every gradient asked for, within the module's bounds."""
    ref_out, ref_grads = _run("torch", x, y, gate)
    tri_out, tri_grads = _run("triton", x, y, gate)
    b, _, d = x.shape
    xf, yf = x.detach().double(), y.detach().double()
    gf = gate.detach().double().reshape(b, 1, d)
    out_bound = ULP[x.dtype] * ref_out.double().abs() + 2.0**-20 * (xf.abs() + (yf * gf).abs())
    _assert_within(tri_out, ref_out, out_bound, f"{what} out")
    if id(x) in ref_grads:
        assert torch.equal(tri_grads[id(x)], ref_grads[id(x)]), f"{what} dx"
    if id(y) in ref_grads:
        ref = ref_grads[id(y)]
        _assert_within(tri_grads[id(y)], ref, ULP[y.dtype] * ref.double().abs(), f"{what} dy")
    if id(gate) in ref_grads:
        dout = torch.randn(
            ref_out.shape, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(11)
        ).to(ref_out.dtype)
        scale = (dout.double() * yf).abs().sum(1).reshape(gate.shape)
        ref = ref_grads[id(gate)]
        bound = ULP[gate.dtype] * ref.double().abs() + 1e-5 * scale
        _assert_within(tri_grads[id(gate)], ref, bound, f"{what} dgate")
    return tri_out, tri_grads


class TestGatedResidualKernel:
    """The Triton path against the reference (collected only in the kernel-checks run)."""

    __test__ = KERNELS_RUN

    @pytest.mark.parametrize(
        "dtypes", DTYPES, ids=["f32", "f32_gate_bf16", "bf16", "bf16_gate_bf16"]
    )
    @pytest.mark.parametrize("shape", SHAPES + LARGE, ids=lambda s: "x".join(map(str, s)))
    def test_matches_reference(self, dtypes, shape) -> None:  # type: ignore[no-untyped-def]
        dtype, gate_dtype = dtypes
        torch.manual_seed(sum(shape))
        x, y = _leaf(shape, dtype, scale=4.0), _leaf(shape, dtype)
        gate = _leaf((shape[0], shape[2]), gate_dtype, scale=0.5)
        out, grads = _check_against_reference(x, y, gate, f"{shape} {dtype} gate {gate_dtype}")
        assert out.dtype == dtype and grads[id(gate)].dtype == gate_dtype

    @pytest.mark.parametrize("dtypes", [(F16, F32), (F32, F16), (BF16, F32)], ids=str)
    def test_other_dtypes(self, dtypes) -> None:  # type: ignore[no-untyped-def]
        """fp16; an fp32 stream with a bf16 / fp16 sublayer output (y keeps its dtype)."""
        x_dtype, y_dtype = dtypes
        torch.manual_seed(1)
        x, y = _leaf((2, 45, 96), x_dtype, 4.0), _leaf((2, 45, 96), y_dtype)
        gate = _leaf((2, 96), F32, 0.5)
        out, grads = _check_against_reference(x, y, gate, f"x {x_dtype} y {y_dtype}")
        assert out.dtype == x_dtype and grads[id(y)].dtype == y_dtype

    def test_strided_inputs(self) -> None:
        """Token slices (batch / token strides), a transposed gate and a transposed output
        gradient (copied), a [b, 1, d] gate, and a gate broadcast over the batch (stride 0,
        whose gradient autograd then sums over the samples)."""
        torch.manual_seed(2)
        b, s, d = 2, 40, 48
        xb = torch.randn(b, s + 7, d, device=DEVICE)
        yb = torch.randn(b, s, d + 5, device=DEVICE)
        x = xb[:, 3 : 3 + s].requires_grad_()
        y_leaf = yb.requires_grad_()
        y = y_leaf[:, :, 2 : 2 + d]
        assert not x.is_contiguous() and y.stride(1) == d + 5
        gates = {
            "transposed": torch.randn(d, b, device=DEVICE).t(),
            "[b, 1, d]": torch.randn(b, 1, d, device=DEVICE),
            "broadcast": torch.randn(1, d, device=DEVICE),
        }
        for name, g0 in gates.items():
            g0 = g0.detach().requires_grad_()
            gate = g0.expand(b, d) if name == "broadcast" else g0
            grads = []
            for impl in ("torch", "triton"):
                out = K.gated_residual(x, y, gate, impl=impl)
                proj = torch.randn(
                    b, d, s, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0)
                )
                loss = (out.transpose(1, 2) * proj).sum()  # a transposed dout
                grads.append([out.detach(), *torch.autograd.grad(loss, (x, y_leaf, g0))])
            for what, a, r in zip(("out", "dx", "dy", "dgate"), *grads, strict=True):
                bound = 1e-5 * r.abs().max() + 1e-6 * r.abs()
                _assert_within(a, r, bound.expand_as(r), f"{name} gate: {what}")

    def test_partial_gradients_and_empty_sequence(self) -> None:
        """Only the gradients asked for are computed (dy alone, dgate alone, none of y's);
        zero tokens give an empty output and a zero dgate."""
        torch.manual_seed(4)
        shape = (2, 37, 48)
        for needs in ((True, True, False), (True, False, True), (False, False, True)):
            x, y = _leaf(shape, BF16), _leaf(shape, BF16)
            gate = _leaf((2, 48), F32)
            for t, need in zip((x, y, gate), needs, strict=True):
                t.requires_grad_(need)
            _check_against_reference(x, y, gate, f"requires_grad {needs}")
        x, y, gate = _leaf((2, 0, 48), BF16), _leaf((2, 0, 48), BF16), _leaf((2, 48), F32)
        out = K.gated_residual(x, y, gate, impl="triton")
        assert out.shape == (2, 0, 48)
        dgate = torch.autograd.grad(out.float().sum(), gate, allow_unused=True)[0]
        assert torch.equal(dgate, torch.zeros(2, 48, device=DEVICE))

    def test_activation_checkpointing(self) -> None:
        """Under non-reentrant checkpointing (y recomputed in the backward) the gradients are
        bit for bit those without it, and match the reference's (``||a - r|| / ||r||``
        within 1e-2, bf16)."""
        torch.manual_seed(5)
        shape = (2, 150, 96)
        x, h = _leaf(shape, BF16, 4.0), _leaf(shape, BF16)
        gate = _leaf((2, 96), F32, 0.5)

        def block(x: torch.Tensor, h: torch.Tensor, gate: torch.Tensor, impl: str):
            out = K.gated_residual(x, torch.tanh(h), gate, impl=impl)
            return out.float().pow(2).sum() / 2  # dout = out: recomputed too

        plain = torch.autograd.grad(block(x, h, gate, "triton"), (x, h, gate))
        ckpt_loss = checkpoint(block, x, h, gate, "triton", use_reentrant=False)
        ckpt = torch.autograd.grad(ckpt_loss, (x, h, gate))
        ref = torch.autograd.grad(block(x, h, gate, "torch"), (x, h, gate))
        for name, a, c, r in zip(("dx", "dh", "dgate"), plain, ckpt, ref, strict=True):
            assert a.abs().max() > 0 and torch.equal(a, c), f"{name}: checkpoint changed it"
            err = ((a.double() - r.double()).norm() / r.double().norm()).item()
            assert err <= 1e-2, f"{name} vs reference: rel err {err:.2e}"

    def test_fake_impls_and_compile(self) -> None:
        """The custom ops' fakes give the kernels' shapes, dtypes and strides (also for
        strided inputs), and torch.compile(fullgraph) traces fwd + bwd through them."""
        from torch.library import opcheck

        torch.manual_seed(6)
        x = torch.randn(2, 9, 48, device=DEVICE, dtype=BF16)
        y = torch.randn(2, 48, 9, device=DEVICE, dtype=BF16).transpose(1, 2)
        gate = torch.randn(48, 2, device=DEVICE).t()
        utils = ("test_schema", "test_faketensor")
        for args in ((x, x, gate.contiguous()), (x[:, 2:], y[:, 2:], gate)):
            opcheck(torch.ops.longboat.gated_residual_fwd, args, test_utils=utils)
        for need in ((True, True), (True, False), (False, True)):
            args = (x, y, gate, *need)
            opcheck(torch.ops.longboat.gated_residual_bwd, args, test_utils=utils)

        xs, ys = _leaf((2, 9, 48), F32), _leaf((2, 9, 48), F32)
        gs = _leaf((2, 48), F32)

        def fn(x: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            return K.gated_residual(x * 2, y, g, impl="triton").pow(2).sum()

        backend = "inductor" if DEVICE == "cuda" else "aot_eager"
        out = torch.compile(fn, backend=backend, fullgraph=True)(xs, ys, gs)
        grads = torch.autograd.grad(out, (xs, ys, gs))
        ref = fn(xs, ys, gs)
        ref_grads = torch.autograd.grad(ref, (xs, ys, gs))
        assert torch.allclose(out, ref, rtol=1e-6, atol=0)
        for a, r in zip(grads, ref_grads, strict=True):
            assert torch.allclose(a, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())
