"""LayerNorm (affine or not): torch reference, Triton kernel, dispatch.

The Triton kernels here are shared with :mod:`longboat.kernels.adaln`: rows come in
groups of ``rows_per_group`` that share one weight/bias row (one group for LayerNorm, one
group per sample for AdaLN), so the backward reduces weight gradients per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longboat.kernels._dispatch import as_rows, num_programs_for_reduction, op, resolve_impl
from longboat.kernels._triton import next_pow2, tl, triton

Tensor = torch.Tensor


def layer_norm_torch(
    x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """Pure-torch reference of :func:`layer_norm` (fp32 statistics, output in x's dtype)."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), x.shape[-1:], w, b, eps).to(x.dtype)


@triton.jit
def _ln_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,
    stride_x, stride_y, stride_wg, stride_bg,
    N, rows_per_group, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, W_PLUS_ONE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    group = row // rows_per_group
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    y = xc * rstd
    if HAS_W:
        w = tl.load(W + group * stride_wg + cols, mask=mask, other=0.0).to(tl.float32)
        if W_PLUS_ONE:
            w += 1.0
        y = y * w
    if HAS_B:
        y += tl.load(B + group * stride_bg + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _ln_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART,
    stride_dy, stride_x, stride_dx, stride_wg,
    N, rows_per_group, rows_per_prog, progs_per_group,
    HAS_W: tl.constexpr, W_PLUS_ONE: tl.constexpr, NEED_WB: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if HAS_W:
        w = tl.load(W + group * stride_wg + cols, mask=mask, other=0.0).to(tl.float32)
        if W_PLUS_ONE:
            w += 1.0
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = group * rows_per_group + chunk * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, (group + 1) * rows_per_group)
    dy_ptr = DY + row_start.to(tl.int64) * stride_dy
    x_ptr = X + row_start.to(tl.int64) * stride_x
    dx_ptr = DX + row_start.to(tl.int64) * stride_dx
    for row in range(row_start, row_end):
        dy = tl.load(dy_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        if HAS_W:
            wdy = w * dy
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        c2 = tl.sum(wdy, axis=0) / N
        dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(dx_ptr + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if NEED_WB:
            dw += dy * xhat
            db += dy
        dy_ptr += stride_dy
        x_ptr += stride_x
        dx_ptr += stride_dx
    if NEED_WB:
        part = (group * progs_per_group + chunk).to(tl.int64) * N
        tl.store(DW_PART + part + cols, dw, mask=mask)
        tl.store(DB_PART + part + cols, db, mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def group_norm_fwd(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    rows_per_group: int,
    eps: float,
    w_plus_one: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the forward; ``weight``/``bias`` are ``[groups, N]`` (or ``[N]`` for one group)."""
    n = x.shape[-1]
    x2 = as_rows(x, n)
    m = x2.shape[0]
    y = torch.empty_like(x2)
    mean = torch.empty(m, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    w = as_rows(weight, n) if weight is not None else x2
    b = as_rows(bias, n) if bias is not None else x2
    block = next_pow2(n)
    if m > 0:
        _ln_fwd_kernel[(m,)](
            x2, w, b, y, mean, rstd,
            x2.stride(0), y.stride(0), w.stride(0), b.stride(0),
            n, max(rows_per_group, 1), eps,
            HAS_W=weight is not None, HAS_B=bias is not None, W_PLUS_ONE=w_plus_one,
            BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return y.view(x.shape), mean, rstd


def group_norm_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    rows_per_group: int,
    w_plus_one: bool,
    need_wb: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward; returns ``dx`` and fp32 ``dw``/``db`` of shape ``[groups, N]``."""
    n = x.shape[-1]
    x2 = as_rows(x, n)
    dy2 = as_rows(dy, n)
    m = x2.shape[0]
    rows_per_group = max(rows_per_group, 1)
    groups = max(m // rows_per_group, 1)
    dx = torch.empty_like(x2)
    progs = max(1, num_programs_for_reduction(m, x.device) // groups)
    progs = min(progs, rows_per_group)
    rows_per_prog = triton.cdiv(rows_per_group, progs)
    progs = triton.cdiv(rows_per_group, rows_per_prog)
    shape = (groups, progs, n) if need_wb else (1, 1, 1)
    dw_part = torch.empty(shape, device=x.device, dtype=torch.float32)
    db_part = torch.empty_like(dw_part)
    w = as_rows(weight, n) if weight is not None else x2
    block = next_pow2(n)
    if m > 0:
        _ln_bwd_kernel[(groups, progs)](
            dy2, x2, w, mean, rstd, dx, dw_part, db_part,
            dy2.stride(0), x2.stride(0), dx.stride(0), w.stride(0),
            n, rows_per_group, rows_per_prog, progs,
            HAS_W=weight is not None, W_PLUS_ONE=w_plus_one, NEED_WB=need_wb,
            BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    elif need_wb:
        dw_part.zero_()
        db_part.zero_()
    if not need_wb:
        return dx.view(x.shape), dw_part, db_part
    return dx.view(x.shape), dw_part.sum(1), db_part.sum(1)


def _layer_norm_fwd_impl(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return group_norm_fwd(x, weight, bias, x.numel() // max(x.shape[-1], 1), eps, False)


_layer_norm_fwd = torch.library.custom_op("longboat::layer_norm_fwd", mutates_args=())(
    _layer_norm_fwd_impl
)


@_layer_norm_fwd.register_fake
def _(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float):
    m = x.numel() // max(x.shape[-1], 1)
    stat = x.new_empty(m, dtype=torch.float32)
    return x.new_empty(x.shape), stat, stat.new_empty(stat.shape)


def _layer_norm_bwd_impl(
    dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor, need_wb: bool
) -> tuple[Tensor, Tensor, Tensor]:
    m = x.numel() // max(x.shape[-1], 1)
    dx, dw, db = group_norm_bwd(dy, x, weight, mean, rstd, m, False, need_wb)
    if not need_wb:
        return dx, x.new_empty(0), x.new_empty(0)
    dtype = weight.dtype if weight is not None else x.dtype
    return dx, dw[0].to(dtype), db[0].to(dtype)


_layer_norm_bwd = torch.library.custom_op("longboat::layer_norm_bwd", mutates_args=())(
    _layer_norm_bwd_impl
)


@_layer_norm_bwd.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor, need_wb: bool):
    if not need_wb:
        return x.new_empty(x.shape), x.new_empty(0), x.new_empty(0)
    dtype = weight.dtype if weight is not None else x.dtype
    n = x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(n, dtype=dtype), x.new_empty(n, dtype=dtype)


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):  # type: ignore[override]
        y, mean, rstd = op("layer_norm_fwd", _layer_norm_fwd_impl)(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_b = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, mean, rstd = ctx.saved_tensors
        need_wb = weight is not None and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
        dx, dw, db = op("layer_norm_bwd", _layer_norm_bwd_impl)(
            dy.contiguous(), x, weight, mean, rstd, need_wb
        )
        dw_out = dw if need_wb and ctx.needs_input_grad[1] else None
        db_out = db if need_wb and ctx.has_b and ctx.needs_input_grad[2] else None
        return dx, dw_out, db_out, None


def layer_norm_triton(
    x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """Triton LayerNorm (fwd + bwd), same signature as :func:`layer_norm_torch`."""
    if bias is not None and weight is None:
        # The kernel's backward derives db alongside dw; a bias alone is rare enough to
        # take the reference path rather than a third kernel variant.
        return layer_norm_torch(x, weight, bias, eps)
    return _LayerNormFn.apply(x, weight, bias, eps)


def layer_norm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    impl: str | None = None,
) -> Tensor:
    """LayerNorm over the last dim, with or without affine ``weight``/``bias``."""
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != x.shape[-1:]:
            raise ValueError(
                f"layer_norm: {name} shape {tuple(t.shape)} must equal x's last dim "
                f"({x.shape[-1]},)"
            )
    if resolve_impl(impl, x) == "torch":
        return layer_norm_torch(x, weight, bias, eps)
    return layer_norm_triton(x, weight, bias, eps)
