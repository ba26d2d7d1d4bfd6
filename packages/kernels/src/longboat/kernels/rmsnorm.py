"""RMSNorm with an optional fused residual add: torch reference, Triton kernel, dispatch.

``rms_norm(x, weight, eps, residual=None)`` returns ``y`` or, with a residual,
``(y, h)`` where ``h = x + residual`` is the new residual stream (in x's dtype) and
``y = h / rms(h) * weight``. Statistics are computed in fp32; ``y`` has x's dtype.

``add_rmsnorm(x, residual, weight, eps)`` is the transformer-layer form of the fused residual:
it returns ``(normed, new_residual)`` with ``new_residual = x + residual`` kept in the
*residual's* dtype (an fp32 residual stream, megatron's ``fp32_residual_connection``, stays
fp32 while ``x`` is bf16) and ``normed`` in x's dtype. Its backward adds the gradient
arriving at ``new_residual`` (from its later use) into the norm's input gradient in the same
pass, so neither the forward add nor the backward gradient sum is a kernel of its own.
"""

from __future__ import annotations

import torch

from longboat.kernels._dispatch import as_rows, num_programs_for_reduction, op, resolve_impl
from longboat.kernels._triton import next_pow2, tl, triton

Tensor = torch.Tensor


def rms_norm_torch(
    x: Tensor, weight: Tensor, eps: float = 1e-6, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """Pure-torch reference of :func:`rms_norm`."""
    h = x if residual is None else x + residual
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if residual is None else (y, h)


def add_rmsnorm_torch(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Pure-torch reference of :func:`add_rmsnorm`: ``(normed, x + residual)``."""
    h = x.to(residual.dtype) + residual  # megatron's bias-dropout-add: x cast to the stream
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype), h


@triton.jit
def _rms_fwd_kernel(
    X, R, W, Y, H, RSTD,
    stride_x, stride_r, stride_y, stride_h,
    N, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the stream dtype first: the norm must see the stored residual.
        h = (x + r).to(H.dtype.element_ty)
        tl.store(H + row * stride_h + cols, h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_bwd_kernel(
    DY, X, W, RSTD, DH, DX, DW_PART,
    stride_dy, stride_x, stride_dh, stride_dx,
    M, N, rows_per_prog,
    HAS_DH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    # Walk row pointers instead of multiplying row * stride (int32 overflow on big tensors).
    dy_ptr = DY + row_start.to(tl.int64) * stride_dy
    x_ptr = X + row_start.to(tl.int64) * stride_x
    dh_ptr = DH + row_start.to(tl.int64) * stride_dh
    dx_ptr = DX + row_start.to(tl.int64) * stride_dx
    for row in range(row_start, row_end):
        dy = tl.load(dy_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        wdy = w * dy
        c = tl.sum(xhat * wdy, axis=0) / N
        dx = (wdy - xhat * c) * rstd
        if HAS_DH:
            dx += tl.load(dh_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        dy_ptr += stride_dy
        x_ptr += stride_x
        dh_ptr += stride_dh
        dx_ptr += stride_dx
    tl.store(DW_PART + pid * N + cols, dw, mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def _rms_norm_fwd_impl(
    x: Tensor, weight: Tensor, residual: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    n = x.shape[-1]
    x2 = as_rows(x, n)
    m = x2.shape[0]
    y = torch.empty_like(x2)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    if residual is not None:
        r2 = as_rows(residual, n)
        h = torch.empty_like(x2)
    else:
        r2, h = x2, y  # unused by the kernel (HAS_RES=False)
    block = next_pow2(n)
    if m > 0:
        _rms_fwd_kernel[(m,)](
            x2, r2, weight, y, h, rstd,
            x2.stride(0), r2.stride(0), y.stride(0), h.stride(0),
            n, eps, HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    h_out = h.view(x.shape) if residual is not None else x.new_empty(0)
    return y.view(x.shape), h_out, rstd


_rms_norm_fwd = torch.library.custom_op("longboat::rms_norm_fwd", mutates_args=())(
    _rms_norm_fwd_impl
)


@_rms_norm_fwd.register_fake
def _(x: Tensor, weight: Tensor, residual: Tensor | None, eps: float):
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape), h, x.new_empty(m, dtype=torch.float32)


def _rms_norm_bwd_impl(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, dh: Tensor | None
) -> tuple[Tensor, Tensor]:
    n = x.shape[-1]
    x2 = as_rows(x, n)
    dy2 = as_rows(dy, n)
    m = x2.shape[0]
    dx = torch.empty_like(x2)
    dh2 = as_rows(dh, n) if dh is not None else dy2
    progs = num_programs_for_reduction(m, x.device)
    dw_part = torch.empty(progs, n, device=x.device, dtype=torch.float32)
    block = next_pow2(n)
    if m > 0:
        _rms_bwd_kernel[(progs,)](
            dy2, x2, weight, rstd, dh2, dx, dw_part,
            dy2.stride(0), x2.stride(0), dh2.stride(0), dx.stride(0),
            m, n, triton.cdiv(m, progs),
            HAS_DH=dh is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    else:
        dw_part.zero_()
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype)


_rms_norm_bwd = torch.library.custom_op("longboat::rms_norm_bwd", mutates_args=())(
    _rms_norm_bwd_impl
)


@_rms_norm_bwd.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, dh: Tensor | None):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps):  # type: ignore[override]
        y, h, rstd = op("rms_norm_fwd", _rms_norm_fwd_impl)(x, weight, residual, eps)
        has_res = residual is not None
        ctx.save_for_backward(h if has_res else x, weight, rstd)
        ctx.has_res = has_res
        ctx.set_materialize_grads(False)
        return (y, h) if has_res else y

    @staticmethod
    def backward(ctx, dy, dh=None):  # type: ignore[override]
        h, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(h)
        dx, dw = op("rms_norm_bwd", _rms_norm_bwd_impl)(dy.contiguous(), h, weight, rstd, dh)
        return dx, dw, (dx if ctx.has_res else None), None


def rms_norm_triton(
    x: Tensor, weight: Tensor, eps: float = 1e-6, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """Triton RMSNorm (fwd + bwd), same signature as :func:`rms_norm_torch`."""
    return _RMSNormFn.apply(x, weight, residual, eps)


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    residual: Tensor | None = None,
    *,
    impl: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim; with ``residual`` returns ``(y, x + residual)``.

    ``impl``: ``"torch"``, ``"triton"`` or ``"auto"`` (default: ``LONGBOAT_KERNELS_IMPL`` env,
    else Triton on CUDA tensors and the torch reference elsewhere).
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm: weight shape {tuple(weight.shape)} must equal x's last dim "
            f"({x.shape[-1]},); pass a weight of the hidden size"
        )
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"rms_norm: residual shape {tuple(residual.shape)} must equal x's shape "
            f"{tuple(x.shape)}"
        )
    # Fused residual: Inductor's fused add + norm is a little faster (benchmarks/notes/kernels.md).
    wins = residual is not None
    if resolve_impl(impl, x, compiled_reference_wins=wins) == "torch":
        return rms_norm_torch(x, weight, eps, residual)
    return rms_norm_triton(x, weight, eps, residual)


def _add_rms_norm_fwd_impl(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    n = x.shape[-1]
    x2, r2 = as_rows(x, n), as_rows(residual, n)
    m = x2.shape[0]
    y = torch.empty_like(x2)
    h = torch.empty(x2.shape, device=x.device, dtype=residual.dtype)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    block = next_pow2(n)
    if m > 0:
        # The residual kernel: stores h in H's dtype (the stream's), y in Y's (x's).
        _rms_fwd_kernel[(m,)](
            x2, r2, weight, y, h, rstd,
            x2.stride(0), r2.stride(0), y.stride(0), h.stride(0),
            n, eps, HAS_RES=True, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return y.view(x.shape), h.view(x.shape), rstd


_add_rms_norm_fwd = torch.library.custom_op("longboat::add_rms_norm_fwd", mutates_args=())(
    _add_rms_norm_fwd_impl
)


@_add_rms_norm_fwd.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float):
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    h = x.new_empty(x.shape, dtype=residual.dtype)
    return x.new_empty(x.shape), h, x.new_empty(m, dtype=torch.float32)


class _AddRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):  # type: ignore[override]
        y, h, rstd = op("add_rms_norm_fwd", _add_rms_norm_fwd_impl)(x, residual, weight, eps)
        ctx.save_for_backward(h, weight, rstd)
        ctx.x_dtype = x.dtype
        ctx.set_materialize_grads(False)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):  # type: ignore[override]
        h, weight, rstd = ctx.saved_tensors
        if dy is None:  # normed unused: the add's gradient only
            if dh is None:
                return None, None, None, None
            return (dh if dh.dtype == ctx.x_dtype else dh.to(ctx.x_dtype)), dh, None, None
        # d(x + residual) = norm backward of dy + the gradient from h's later use, one pass,
        # written in h's dtype (the residual stream's).
        dres, dw = op("rms_norm_bwd", _rms_norm_bwd_impl)(dy.contiguous(), h, weight, rstd, dh)
        dx = dres if dres.dtype == ctx.x_dtype else dres.to(ctx.x_dtype)
        return dx, dres, dw, None


def add_rmsnorm_triton(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Triton fused residual add + RMSNorm (fwd + bwd), same signature as the reference."""
    return _AddRMSNormFn.apply(x, residual, weight, eps)


def add_rmsnorm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    *,
    impl: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(normed, new_residual)``: ``new_residual = x + residual`` in the residual's dtype,
    ``normed = new_residual / rms(new_residual) * weight`` in x's dtype (fp32 statistics,
    one rounding).

    The transformer layer's "add the sublayer output to the stream, then normalise for the
    next sublayer" in one pass each way: forward reads ``x``, ``residual`` and writes
    ``new_residual``, ``normed``; backward reads ``d normed``, ``new_residual`` and the
    gradient of ``new_residual``'s later use, and writes the summed input gradient (returned
    for both ``x`` and ``residual``; cast to x's dtype where the two differ).
    ``impl``: as :func:`rms_norm`.
    """
    if residual.shape != x.shape:
        raise ValueError(
            f"add_rmsnorm: residual shape {tuple(residual.shape)} must equal x's shape "
            f"{tuple(x.shape)}; pass the residual stream the sublayer output is added to"
        )
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"add_rmsnorm: weight shape {tuple(weight.shape)} must equal x's last dim "
            f"({x.shape[-1]},); pass a weight of the hidden size"
        )
    # Under torch.compile the reference goes to Inductor (as rms_norm's fused residual).
    if resolve_impl(impl, x, residual, compiled_reference_wins=True) == "torch":
        return add_rmsnorm_torch(x, residual, weight, eps)
    return add_rmsnorm_triton(x, residual, weight, eps)
