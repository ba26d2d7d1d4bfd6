"""Triton kernels of ``quantize``: amax, scale and cast in one pass per tile.

- ``_quant_groups_kernel``: ``[BR, GROUP]`` tiles, one scale per row of a tile: the 1x128
  activation tiles (``GROUP=128``) and whole rows (``GROUP`` = the row length rounded up to a
  power of two). The input is read through its strides, so ``x.t()`` (the wgrad operands,
  quantised along the token dimension) needs no transposed copy first.
- ``_quant_blocks_kernel``: 128 x 128 blocks, one scale each (weights).
- ``_quant_scaled_kernel``: the cast with one scale (tensorwise; the amax is a torch
  reduction before it).
- ``_quant_dual_kernel``: a 128 x 128 tile read once and quantised twice, 1x128 along each
  dimension, the second written transposed: an FP8 linear's ``x`` for the forward GEMM and
  ``x^T`` for the weight gradient (and ``dy`` / ``dy^T`` in the backward) from one read.
  ``_quant_blocks_kernel`` with ``TRANS`` writes ``W^T``'s 128x128 operand the same way.

The FP8 codes equal the torch reference's (``x / scale``, clamped to the format's range,
rounded to nearest even). On the GPU the cast rounds; Triton's CPU interpreter converts to
FP8 with its own code, which loses the carry when rounding up crosses a power of two (31.5
-> 16), so under the interpreter (``ROUND``) the kernels first round to the FP8 grid in fp32
(``_round_to_grid``), leaving the cast exact.
"""

from __future__ import annotations

import torch

from longboat.kernels._dispatch import triton_interpreter_on
from longboat.kernels._triton import next_pow2, tl, triton

Tensor = torch.Tensor


@triton.jit
def _round_to_grid(q, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """``q`` rounded to nearest even on the grid of an FP8 format with ``MANT`` mantissa bits
    and smallest normal exponent ``MIN_EXP`` (subnormals: the step of the smallest binade)."""
    a = tl.abs(q)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), MIN_EXP)
    step = tl.exp2(e - MANT)
    v = a / step
    r = tl.floor(v + 0.5)
    r = tl.where((r - v == 0.5) & (r % 2.0 != 0.0), r - 1.0, r)
    return tl.where(q < 0, -r * step, r * step)


@triton.jit
def _quant_groups_kernel(
    X, Q, S,
    R, C,
    stride_xr, stride_xc, stride_sr, stride_sc,
    FMAX: tl.constexpr, FLOOR: tl.constexpr, BR: tl.constexpr, GROUP: tl.constexpr,
    ROUND: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * GROUP + tl.arange(0, GROUP)
    rmask = rows < R
    mask = rmask[:, None] & (cols[None, :] < C)
    r64 = rows.to(tl.int64)
    x = tl.load(
        X + r64[:, None] * stride_xr + cols[None, :].to(tl.int64) * stride_xc, mask=mask, other=0.0
    ).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(amax, FLOOR) / FMAX
    q = tl.minimum(tl.maximum(x / scale[:, None], -FMAX), FMAX)
    if ROUND:
        q = _round_to_grid(q, MANT, MIN_EXP)
    tl.store(Q + r64[:, None] * C + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + r64 * stride_sr + pid_c * stride_sc, scale, mask=rmask)


@triton.jit
def _quant_blocks_kernel(
    X, Q, S,
    R, C,
    stride_xr, stride_xc, stride_sr,
    FMAX: tl.constexpr, FLOOR: tl.constexpr, B: tl.constexpr,
    ROUND: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr, TRANS: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * B + tl.arange(0, B)
    cols = pid_c * B + tl.arange(0, B)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    r64 = rows.to(tl.int64)
    x = tl.load(
        X + r64[:, None] * stride_xr + cols[None, :].to(tl.int64) * stride_xc, mask=mask, other=0.0
    ).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.maximum(amax, FLOOR) / FMAX
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    if ROUND:
        q = _round_to_grid(q, MANT, MIN_EXP)
    if TRANS:  # the operand of X^T: [C, R] row-major, block (pid_c, pid_r) of its scales
        c64 = cols.to(tl.int64)
        qt = tl.trans(q.to(Q.dtype.element_ty))
        tl.store(Q + c64[:, None] * R + r64[None, :], qt, mask=tl.trans(mask))
        tl.store(S + pid_c * stride_sr + pid_r, scale)
    else:
        tl.store(Q + r64[:, None] * C + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
        tl.store(S + pid_r * stride_sr + pid_c, scale)


@triton.jit
def _dual_tile_store(
    x, rows, cols, rmask, cmask, pid_r, pid_c,
    Q, S, QT, ST,
    R, C,
    stride_sr, stride_sc, stride_str, stride_stc,
    FMAX: tl.constexpr, FLOOR: tl.constexpr,
    ROUND: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
):  # fmt: skip
    """Quantise the fp32 tile ``x`` (rows ``rows``, columns ``cols`` of an ``[R, C]`` matrix)
    twice, 1x128 along C into ``Q`` / ``S`` and along R into ``QT`` ``[C, R]`` / ``ST``
    (written transposed): the body of ``_quant_dual_kernel``, shared with the producers that
    quantise their output in place of writing it (``fp8.glu_quant``)."""
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    ax = tl.abs(x)
    s_row = tl.maximum(tl.max(ax, axis=1), FLOOR) / FMAX
    q = tl.minimum(tl.maximum(x / s_row[:, None], -FMAX), FMAX)
    if ROUND:
        q = _round_to_grid(q, MANT, MIN_EXP)
    tl.store(Q + r64[:, None] * C + c64[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + r64 * stride_sr + pid_c * stride_sc, s_row, mask=rmask)
    s_col = tl.maximum(tl.max(ax, axis=0), FLOOR) / FMAX
    qc = tl.minimum(tl.maximum(x / s_col[None, :], -FMAX), FMAX)
    if ROUND:
        qc = _round_to_grid(qc, MANT, MIN_EXP)
    qt = tl.trans(qc.to(QT.dtype.element_ty))
    tl.store(QT + c64[:, None] * R + r64[None, :], qt, mask=tl.trans(mask))
    tl.store(ST + c64 * stride_str + pid_r * stride_stc, s_col, mask=cmask)


@triton.jit
def _quant_dual_kernel(
    X, Q, S, QT, ST,
    R, C,
    stride_xr, stride_xc, stride_sr, stride_sc, stride_str, stride_stc,
    FMAX: tl.constexpr, FLOOR: tl.constexpr, B: tl.constexpr,
    ROUND: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
):  # fmt: skip
    """One read of a ``[B, B]`` tile of ``X`` ``[R, C]``, two 1x128 quantisations: along C
    (``Q`` ``[R, C]``, a scale per row of the tile) and along R, written transposed (``QT``
    ``[C, R]``, a scale per column of the tile)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * B + tl.arange(0, B)
    cols = pid_c * B + tl.arange(0, B)
    rmask = rows < R
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_xr + c64[None, :] * stride_xc, mask=mask, other=0.0).to(
        tl.float32
    )
    _dual_tile_store(
        x, rows, cols, rmask, cmask, pid_r, pid_c, Q, S, QT, ST, R, C,
        stride_sr, stride_sc, stride_str, stride_stc,
        FMAX=FMAX, FLOOR=FLOOR, ROUND=ROUND, MANT=MANT, MIN_EXP=MIN_EXP,
    )  # fmt: skip


@triton.jit
def _quant_scaled_kernel(
    X, Q, S,
    R, C,
    stride_xr, stride_xc,
    FMAX: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ROUND: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    r64 = rows.to(tl.int64)
    x = tl.load(
        X + r64[:, None] * stride_xr + cols[None, :].to(tl.int64) * stride_xc, mask=mask, other=0.0
    ).to(tl.float32)
    scale = tl.load(S)
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    if ROUND:
        q = _round_to_grid(q, MANT, MIN_EXP)
    tl.store(Q + r64[:, None] * C + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)


def _grid_args(dtype: torch.dtype) -> dict[str, object]:
    return {
        "ROUND": triton_interpreter_on(),
        "MANT": 3 if dtype == torch.float8_e4m3fn else 2,
        "MIN_EXP": -6 if dtype == torch.float8_e4m3fn else -14,
    }


def quantize_blocks_transposed_triton(
    x: Tensor, scale: Tensor, dtype: torch.dtype, fmax: float, floor: float
) -> Tensor:
    """The ``128x128`` quantisation of ``x^T`` from ``x`` ``[R, C]`` read row by row: the FP8
    ``[C, R]`` data (returned) and its scales written into ``scale`` (``[ceil(C/128),
    ceil(R/128)]``, the 128x128 layout of ``x^T``). Same codes and scales as quantising
    ``x.t()``, without its strided reads."""
    rows, cols = x.shape
    q = torch.empty(cols, rows, device=x.device, dtype=dtype)
    if rows == 0 or cols == 0:
        return q
    grid = (triton.cdiv(rows, 128), triton.cdiv(cols, 128))
    _quant_blocks_kernel[grid](
        x, q, scale, rows, cols, x.stride(0), x.stride(1), scale.stride(0),
        FMAX=fmax, FLOOR=floor, B=128, num_warps=8, TRANS=True, **_grid_args(dtype),
    )  # fmt: skip
    return q


def quantize_dual_triton(
    x: Tensor, scale: Tensor, scale_t: Tensor, dtype: torch.dtype, fmax: float, floor: float
) -> tuple[Tensor, Tensor]:
    """The 1x128 quantisations of ``x`` ``[R, C]`` along C and of ``x^T`` along R in one
    pass: ``(data [R, C], data_t [C, R])``, the scales written into ``scale`` (``[R,
    ceil(C/128)]``) and ``scale_t`` (``[C, ceil(R/128)]``) in the 1x128 layout."""
    rows, cols = x.shape
    q = torch.empty(rows, cols, device=x.device, dtype=dtype)
    qt = torch.empty(cols, rows, device=x.device, dtype=dtype)
    if rows == 0 or cols == 0:
        return q, qt
    grid = (triton.cdiv(rows, 128), triton.cdiv(cols, 128))
    _quant_dual_kernel[grid](
        x, q, scale, qt, scale_t, rows, cols, x.stride(0), x.stride(1),
        scale.stride(0), scale.stride(1), scale_t.stride(0), scale_t.stride(1),
        FMAX=fmax, FLOOR=floor, B=128, num_warps=8, **_grid_args(dtype),
    )  # fmt: skip
    return q, qt


def quantize_triton(
    x: Tensor, scale: Tensor, granularity: str, dtype: torch.dtype, fmax: float, floor: float
) -> Tensor:
    """Quantise ``x`` ``[R, C]`` into a new row-major FP8 tensor, writing the scales into
    ``scale`` (allocated by the caller in the granularity's layout); returns the data."""
    rows, cols = x.shape
    q = torch.empty(rows, cols, device=x.device, dtype=dtype)
    grid_args = _grid_args(dtype)
    if rows == 0 or cols == 0:
        return q
    sx_r, sx_c = x.stride()
    if granularity in ("1x128", "row"):
        group = 128 if granularity == "1x128" else next_pow2(cols)
        br = max(1, min(32, 4096 // group))
        grid = (triton.cdiv(rows, br), triton.cdiv(cols, group))
        s_r, s_c = (scale.stride(0), scale.stride(1))
        _quant_groups_kernel[grid](
            x, q, scale, rows, cols, sx_r, sx_c, s_r, s_c,
            FMAX=fmax, FLOOR=floor, BR=br, GROUP=group, num_warps=4 if group <= 1024 else 16, **grid_args,
        )  # fmt: skip
    elif granularity == "128x128":
        grid = (triton.cdiv(rows, 128), triton.cdiv(cols, 128))
        _quant_blocks_kernel[grid](
            x, q, scale, rows, cols, sx_r, sx_c, scale.stride(0),
            FMAX=fmax, FLOOR=floor, B=128, num_warps=8, TRANS=False, **grid_args,
        )  # fmt: skip
    else:  # tensor
        # max |x| in one reduction over x as laid out (no |x| temporary; exact, like a max)
        amax = torch.linalg.vector_norm(x, ord=float("inf"))
        scale.copy_(amax.float().clamp(min=floor) / fmax)
        grid = (triton.cdiv(rows, 32), triton.cdiv(cols, 128))
        _quant_scaled_kernel[grid](
            x, q, scale, rows, cols, sx_r, sx_c, FMAX=fmax, BR=32, BC=128, num_warps=4, **grid_args,
        )  # fmt: skip
    return q


def fp8_quantize_eager(x: Tensor, granularity: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(data, scale buffer)`` of ``x`` (``quantize.scale_view`` gives the scale tensor)."""
    from longboat.kernels.fp8.quantize import AMAX_FLOOR, fp8_max, scale_storage_shape, scale_view

    rows, k = x.shape
    make = torch.zeros if granularity == "128x128" else torch.empty
    storage = make(scale_storage_shape(rows, k, granularity), device=x.device, dtype=torch.float32)
    scale = scale_view(storage, granularity, k)
    data = quantize_triton(x, scale, granularity, dtype, fp8_max(dtype), AMAX_FLOOR)
    return data, storage


def fp8_quantize_dual_eager(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(data, scale buffer, data_t, scale_t buffer)``: the 1x128 operands of ``x`` and
    ``x^T`` (``quantize.scale_view`` gives each scale tensor)."""
    from longboat.kernels.fp8.quantize import AMAX_FLOOR, fp8_max, scale_storage_shape, scale_view

    rows, k = x.shape
    storage = torch.empty(
        scale_storage_shape(rows, k, "1x128"), device=x.device, dtype=torch.float32
    )
    storage_t = torch.empty(
        scale_storage_shape(k, rows, "1x128"), device=x.device, dtype=torch.float32
    )
    data, data_t = quantize_dual_triton(
        x, scale_view(storage, "1x128", k), scale_view(storage_t, "1x128", rows), dtype,
        fp8_max(dtype), AMAX_FLOOR,
    )  # fmt: skip
    return data, storage, data_t, storage_t


def fp8_quantize_blocks_t_eager(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(data, scale buffer)`` of the 128x128 operand of ``x^T``."""
    from longboat.kernels.fp8.quantize import AMAX_FLOOR, fp8_max, scale_storage_shape, scale_view

    rows, k = x.shape
    storage = torch.zeros(
        scale_storage_shape(k, rows, "128x128"), device=x.device, dtype=torch.float32
    )
    data = quantize_blocks_transposed_triton(
        x, scale_view(storage, "128x128", rows), dtype, fp8_max(dtype), AMAX_FLOOR
    )
    return data, storage


_fp8_quantize = torch.library.custom_op("longboat::fp8_quantize", mutates_args=())(
    fp8_quantize_eager
)
_fp8_quantize_dual = torch.library.custom_op("longboat::fp8_quantize_dual", mutates_args=())(
    fp8_quantize_dual_eager
)
_fp8_quantize_blocks_t = torch.library.custom_op(
    "longboat::fp8_quantize_blocks_t", mutates_args=()
)(fp8_quantize_blocks_t_eager)


@_fp8_quantize_dual.register_fake
def _(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from longboat.kernels.fp8.quantize import scale_storage_shape

    rows, k = x.shape
    return (
        x.new_empty((rows, k), dtype=dtype),
        x.new_empty(scale_storage_shape(rows, k, "1x128"), dtype=torch.float32),
        x.new_empty((k, rows), dtype=dtype),
        x.new_empty(scale_storage_shape(k, rows, "1x128"), dtype=torch.float32),
    )


@_fp8_quantize_blocks_t.register_fake
def _(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    from longboat.kernels.fp8.quantize import scale_storage_shape

    rows, k = x.shape
    storage = x.new_empty(scale_storage_shape(k, rows, "128x128"), dtype=torch.float32)
    return x.new_empty((k, rows), dtype=dtype), storage


@_fp8_quantize.register_fake
def _(x: Tensor, granularity: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    from longboat.kernels.fp8.quantize import scale_storage_shape

    rows, k = x.shape
    storage = x.new_empty(scale_storage_shape(rows, k, granularity), dtype=torch.float32)
    return x.new_empty((rows, k), dtype=dtype), storage


__all__ = [
    "fp8_quantize_blocks_t_eager",
    "fp8_quantize_dual_eager",
    "fp8_quantize_eager",
    "quantize_blocks_transposed_triton",
    "quantize_dual_triton",
    "quantize_triton",
]
