"""Fused residual add + RMSNorm (``add_rmsnorm``): Triton vs the torch reference, fwd + bwd.

Not collected by the default run (no ``test_`` prefix): ``test_add_rmsnorm.py`` runs this file
in a subprocess, on CPU with ``TRITON_INTERPRET=1`` (set before triton is imported) or on CUDA
with ``LONGBOAT_KERNEL_TEST_DEVICE=cuda``.

Tolerances, as ``||triton - ref|| / ||ref||`` per tensor, by that tensor's dtype: fp32 1e-5
(outputs) and 1e-4 (gradients: a different summation order of the row and weight
reductions); bf16 1e-2 for both (both sides compute in fp32 and round once; the gap is a few
rounding flips). ``new_residual`` is one rounded add on both sides, so it must be
bit-identical; except that Triton's CPU interpreter rounds fp32 -> bf16 toward zero where CUDA
rounds to nearest even, so a bf16 stream is held to one bf16 ulp there.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("LONGBOAT_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 on CPU", allow_module_level=True)

from longboat import kernels as K  # noqa: E402  (after the interpreter check)

TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1e-2)}
F32, BF16 = torch.float32, torch.bfloat16
# (x dtype, residual dtype): bf16 stream, fp32 model, bf16 sublayer into an fp32 stream
# (megatron's fp32_residual_connection).
DTYPES = [(F32, F32), (BF16, BF16), (BF16, F32)]
DTYPE_IDS = ["fp32", "bf16", "bf16_into_fp32_stream"]
# Non-power-of-two hidden sizes, one row, a 3-d [s, b, h] input, the 886M Llama's hidden.
SHAPES = [(1, 200), (37, 96), (6, 1000), (5, 3, 2048)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def leaf(shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype).requires_grad_()


def run(impl: str, x, r, w, use: str):  # type: ignore[no-untyped-def]
    """Forward, then backward of a random projection of the outputs in ``use``."""
    for t in (x, r, w):
        t.grad = None
    normed, new_res = K.add_rmsnorm(x, r, w, 1e-6, impl=impl)
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    loss = torch.zeros((), device=DEVICE)
    for name, o in (("normed", normed), ("residual", new_res)):
        proj = torch.randn(o.shape, device=DEVICE, generator=gen)
        if name in use:
            loss = loss + (o.float() * proj).sum()
    loss.backward()
    grads = tuple(torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in (x, r, w))
    return (normed.detach(), new_res.detach()), grads


@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("use", ["both", "normed", "residual"])
def test_add_rmsnorm_matches_reference(dtypes, shape, use) -> None:  # type: ignore[no-untyped-def]
    """Values and all three gradients; ``use`` picks which outputs the loss reads (both: the
    norm's gradient and the later use's gradient meet in one backward pass)."""
    x_dtype, r_dtype = dtypes
    torch.manual_seed(sum(shape))
    x = leaf(shape, x_dtype)
    r = leaf(shape, r_dtype, scale=4.0)  # a stream larger than the sublayer output
    w = leaf(shape[-1:], x_dtype)
    use = "normed residual" if use == "both" else use
    (ref_out, ref_grad) = run("torch", x, r, w, use)
    (tri_out, tri_grad) = run("triton", x, r, w, use)
    what = f"add_rmsnorm[{shape}, {x_dtype}+{r_dtype}, {use}]"

    # dtypes: normed in x's, the new residual in the stream's; gradients in their inputs'.
    assert tri_out[0].dtype == x_dtype and tri_out[1].dtype == r_dtype, what
    assert [g.dtype for g in tri_grad] == [x_dtype, r_dtype, x_dtype], what
    # The residual add is one rounding to the stream's dtype on both sides.
    exact = x.detach().to(r_dtype) + r.detach()
    assert torch.equal(ref_out[1], exact), what
    if r_dtype == F32 or DEVICE == "cuda":
        assert torch.equal(tri_out[1], exact), f"{what}: new_residual not bit-identical"
    else:  # the interpreter rounds fp32 -> bf16 toward zero, CUDA to nearest: one bf16 ulp
        ulp = exact.float().abs() * 2.0**-7
        assert ((tri_out[1].float() - exact.float()).abs() <= ulp).all(), what
    tol_out = TOL[x_dtype][0]
    assert rel_err(tri_out[0], ref_out[0]) <= tol_out, (what, rel_err(tri_out[0], ref_out[0]))
    for i, (a, b) in enumerate(zip(tri_grad, ref_grad, strict=True)):
        assert a.shape == b.shape and torch.isfinite(a).all(), f"{what} grad{i}"
        tol = TOL[a.dtype][1]
        if use == "residual" and i == 2:  # the weight gets no gradient without normed
            assert a.abs().max().item() == 0.0 and b.abs().max().item() == 0.0, what
            continue
        assert rel_err(a, b) <= tol, f"{what} grad{i}: rel err {rel_err(a, b):.2e} > {tol}"


def test_reference_equals_the_unfused_layer() -> None:
    """The reference (fp32) is what megatron's layer computes unfused (``residual + x``, then
    the norm): checked against that formula in fp64 on the same inputs, values and gradients
    (fp32 rounding: within 1e-6)."""
    torch.manual_seed(5)
    x, r, w = (torch.randn(*s, device=DEVICE) for s in ((7, 96), (7, 96), (96,)))
    ins = [t.clone().requires_grad_() for t in (x, r, w)]
    ins64 = [t.double().requires_grad_() for t in (x, r, w)]
    y, h = K.add_rmsnorm_torch(*ins, 1e-6)
    h2 = ins64[1] + ins64[0]
    y2 = h2 / (h2.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * ins64[2]
    proj = torch.randn(7, 96, device=DEVICE)
    g1 = torch.autograd.grad((y * proj).sum() + (h * 3).sum(), ins)
    g2 = torch.autograd.grad((y2 * proj.double()).sum() + (h2 * 3).sum(), ins64)
    assert rel_err(y, y2) <= 1e-6 and rel_err(h, h2) <= 1e-7
    assert all(rel_err(a, b) <= 1e-6 for a, b in zip(g1, g2))


def test_add_rmsnorm_fake_impl_and_compile() -> None:
    """The custom op's fake gives the kernel's shapes / dtypes (also a non-contiguous x and an
    fp32 stream), and torch.compile(fullgraph) traces fwd + bwd through it."""
    from torch.library import opcheck

    torch.manual_seed(3)
    x = torch.randn(96, 6, device=DEVICE).t()  # [6, 96], last stride 6
    w = torch.randn(96, device=DEVICE)
    for args in (
        (x, x * 0.5, w, 1e-6),
        (x.to(BF16), torch.randn(6, 96, device=DEVICE), w.to(BF16), 1e-6),
    ):
        opcheck(torch.ops.longboat.add_rms_norm_fwd, args, test_utils=("test_faketensor",))

    xs = torch.randn(4, 96, device=DEVICE, requires_grad=True)
    rs = torch.randn(4, 96, device=DEVICE, requires_grad=True)
    ws = torch.randn(96, device=DEVICE, requires_grad=True)

    def fn(x, r, w):  # type: ignore[no-untyped-def]
        y, h = K.add_rmsnorm(x, r, w, 1e-6, impl="triton")
        return (y * h).sum() + h.pow(2).sum()

    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    out = torch.compile(fn, backend=backend, fullgraph=True)(xs, rs, ws)
    grads = torch.autograd.grad(out, (xs, rs, ws))
    ref = fn(xs, rs, ws)
    ref_grads = torch.autograd.grad(ref, (xs, rs, ws))
    assert rel_err(out, ref) <= 1e-5
    assert all(rel_err(a, b) <= 1e-4 for a, b in zip(grads, ref_grads))


def test_add_rmsnorm_rejects_bad_shapes() -> None:
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual shape"):
        K.add_rmsnorm(x, torch.randn(3, 9, device=DEVICE), torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match="weight shape"):
        K.add_rmsnorm(x, x, torch.ones(9, device=DEVICE))
