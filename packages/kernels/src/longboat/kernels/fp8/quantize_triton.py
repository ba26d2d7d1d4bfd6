"""Triton kernels of ``quantize``: amax, scale and cast in one pass per tile.

- ``_quant_groups_kernel``: ``[BR, GROUP]`` tiles, one scale per row of a tile: the 1x128
  activation tiles (``GROUP=128``) and whole rows (``GROUP`` = the row length rounded up to a
  power of two). The input is read through its strides, so ``x.t()`` (the wgrad operands,
  quantised along the token dimension) needs no transposed copy first.
- ``_quant_blocks_kernel``: 128 x 128 blocks, one scale each (weights).
- ``_quant_scaled_kernel``: the cast with one scale (tensorwise; the amax is a torch
  reduction before it).
- ``_quant_dual_kernel``: a 128 x 128 tile quantised twice, 1x128 along each dimension, the
  second written transposed: an FP8 linear's ``x`` for the forward GEMM and ``x^T`` for the
  weight gradient (and ``dy`` / ``dy^T`` in the backward) from one program per tile.
  ``_quant_blocks_kernel`` with ``TRANS`` writes ``W^T``'s 128x128 operand the same way.

The dual and blocks kernels walk their tile in chunks (``TileConfig``): a row-wise pass over
``[sub_rows, 128]`` chunks, then a column-wise pass whose second read of the tile hits L2.
Holding the whole tile in fp32 (64 values a thread at 8 warps, and its temporaries) took
149 registers a thread, so one 256-thread program ran per SM: a third of the memory
bandwidth.

The FP8 codes equal the torch reference's (``x / scale``, clamped to the format's range,
rounded to nearest even). Scales and quotients are IEEE divisions (``tl.math.div_rn``): on
the GPU Triton's ``/`` on fp32 is ``div.full.f32``, within 2 ulp, which moves a scale by an
ulp and a code across a rounding boundary now and then. On the GPU the cast rounds;
Triton's CPU interpreter converts to FP8 with its own code, which loses the carry when
rounding up crosses a power of two (31.5 -> 16), so under the interpreter (``ROUND``) the
kernels first round to the FP8 grid in fp32 (``_round_to_grid``), leaving the cast exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longboat.kernels._dispatch import triton_interpreter_on
from longboat.kernels._triton import next_pow2, tl, triton

Tensor = torch.Tensor
_TILE = 128
"""Side of the tiles of the dual and blocks kernels (``quantize.BLOCK``)."""


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
def _row_chunk(X, first, end, c64, cmask, stride_xr, stride_xc, SUB: tl.constexpr):
    """Rows ``first .. first + SUB`` of ``X`` at the columns ``c64`` (``cmask``), in X's
    dtype; rows at or past ``end`` read as zeros without touching memory."""
    rows = first + tl.arange(0, SUB)
    mask = (rows[:, None] < end) & cmask[None, :]
    ptrs = X + rows.to(tl.int64)[:, None] * stride_xr + c64[None, :] * stride_xc
    return tl.load(ptrs, mask=mask, other=0.0)


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
    scale = tl.math.div_rn(tl.maximum(amax, FLOOR), FMAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FMAX), FMAX)
    if ROUND:
        q = _round_to_grid(q, MANT, MIN_EXP)
    tl.store(Q + r64[:, None] * C + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + r64 * stride_sr + pid_c * stride_sc, scale, mask=rmask)


COLUMN_PASSES = ("load_t", "trans", "rows")
"""How the column-wise pass of a ``TileConfig`` walks the tile (``TileConfig.column_pass``)."""


@dataclass(frozen=True)
class TileConfig:
    """How ``_quant_dual_kernel`` and ``_quant_blocks_kernel`` walk their 128 x 128 tile.

    The tile is never held whole: a row-wise pass reads ``[sub_rows, 128]`` chunks and a
    column-wise pass re-reads the tile (from L2) in chunks, so a thread holds a few values of
    a chunk at a time. Candidates: ``TILE_CONFIGS``; the library's choice: ``DUAL_CONFIG``,
    ``BLOCKS_CONFIG``, ``BLOCKS_T_CONFIG`` (``tools/bench/fp8_quant.py`` times them all)."""

    sub_rows: int
    """Rows of a row-wise chunk (a power of two dividing 128)."""
    sub_cols: int
    """Columns of a column-wise chunk (a power of two dividing 128; unused by ``rows``)."""
    num_warps: int
    """Warps of a program (one program per 128 x 128 tile)."""
    column_pass: str = "load_t"
    """``load_t``: ``[sub_cols, 128]`` chunks read through transposed addresses and stored
    as laid out (each row of the transposed output gets 128 contiguous bytes); ``trans``:
    ``[128, sub_cols]`` chunks stored through ``tl.trans``; ``rows``: the column amax is
    gathered in the row-wise pass, then ``[sub_rows, 128]`` chunks are re-read and stored
    through ``tl.trans`` (``sub_rows`` contiguous bytes a row of the output; fewest values
    a thread)."""
    prefetch: bool = False
    """Loops over row chunks load the next chunk (in X's dtype) before working on the
    current one: twice the bytes in flight a program, for a chunk's worth of registers."""

    @property
    def name(self) -> str:
        """``r<sub_rows>c<sub_cols>w<num_warps>-<column_pass>`` (no ``c`` for ``rows``; ``-p``
        with ``prefetch``)."""
        cols = "" if self.column_pass == "rows" else f"c{self.sub_cols}"
        tail = "-p" if self.prefetch else ""
        return f"r{self.sub_rows}{cols}w{self.num_warps}-{self.column_pass}{tail}"

    def kernel_args(self) -> dict[str, object]:
        """The launch arguments of this config (constexprs and ``num_warps``)."""
        for n in (self.sub_rows, self.sub_cols):
            if n < 1 or n > _TILE or _TILE % n or n & (n - 1):
                raise ValueError(f"{self}: chunk sides must be powers of two dividing {_TILE}")
        if self.column_pass not in COLUMN_PASSES:
            raise ValueError(f"{self}: column_pass must be one of {COLUMN_PASSES}")
        return {
            "SUB": self.sub_rows,
            "SUBC": self.sub_cols,
            "COLS": COLUMN_PASSES.index(self.column_pass),
            "PREFETCH": self.prefetch,
            "num_warps": self.num_warps,
        }


TILE_CONFIGS: tuple[TileConfig, ...] = (
    TileConfig(16, 16, 8, "rows"),
    TileConfig(16, 16, 8, "rows", prefetch=True),
    TileConfig(32, 32, 8, "rows"),
    TileConfig(32, 32, 16, "rows"),
    TileConfig(32, 32, 16, "rows", prefetch=True),
    TileConfig(64, 64, 16, "rows"),
    TileConfig(16, 8, 8, "load_t"),
    TileConfig(16, 16, 8, "load_t"),
    TileConfig(32, 16, 8, "load_t"),
    TileConfig(16, 32, 8, "trans"),
)
"""The configs a GPU benchmark picks from (``tools/bench/fp8_quant.py``). Registers a thread
(ptxas, sm_90a; dual / blocks / blocks transposed), in order: 48/40/42, 60/40/54, 80/46/63,
51/36/32, 62/40/37, 64/45/46, 47/40/35, 62/40/48, 59/46/43, 80/40/50; none spills. The
whole-tile kernels took 149/89/94."""
DUAL_CONFIG = TILE_CONFIGS[1]
"""``_quant_dual_kernel``'s config, r16w8-rows-p: 256 threads, a ``[16, 128]`` bf16 chunk is
one 16-byte load a thread, the next chunk's load issued before this one is worked on; the
column amax is gathered as the rows go by (no chunk needs a reduction across warps of its
own). 60 registers a thread: 4 programs (32 warps) an SM with 2 x 4 KB of loads in flight
each, 32 KB an SM, more than HBM's bandwidth x latency share of an SM (~20 KB). The
transposed codes leave in 16-byte pieces of a row, which L2 merges with the next chunk's."""
BLOCKS_CONFIG = TILE_CONFIGS[1]
"""``_quant_blocks_kernel``'s config for ``W``'s row-major operand, r16w8-rows-p: the amax
pass and the codes pass over ``[16, 128]`` chunks with the next one's load in flight; 40
registers a thread (6 programs an SM)."""
BLOCKS_T_CONFIG = TILE_CONFIGS[8]
"""``_quant_blocks_kernel``'s config for ``W^T``'s operand (``TRANS``), r32c16w8-load_t: the
amax over ``[32, 128]`` row chunks (two 16-byte loads a thread), the codes by ``[16, 128]``
transposed chunks (128 contiguous bytes a row of ``W^T``); 43 registers a thread (5
programs an SM)."""


@triton.jit
def _quant_blocks_kernel(
    X, Q, S,
    R, C,
    stride_xr, stride_xc, stride_sr,
    FMAX: tl.constexpr, FLOOR: tl.constexpr, B: tl.constexpr,
    SUB: tl.constexpr, SUBC: tl.constexpr, COLS: tl.constexpr, PREFETCH: tl.constexpr,
    ROUND: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr, TRANS: tl.constexpr,
):  # fmt: skip
    """One scale per ``[B, B]`` block of ``X`` ``[R, C]``: the amax over ``[SUB, B]`` row
    chunks, then the codes chunk by chunk: ``Q`` ``[R, C]`` by row chunks, or with ``TRANS``
    ``Q`` ``[C, R]`` (the operand of ``X^T``) written transposed, by ``SUBC``-column chunks
    (``COLS`` 0: read through transposed addresses, 1: through ``tl.trans``) or by row
    chunks (``COLS`` 2)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    cols = pid_c * B + tl.arange(0, B)
    cmask = cols < C
    c64 = cols.to(tl.int64)
    end = tl.minimum(R, pid_r * B + B)
    acc = tl.zeros([SUB, B], dtype=tl.float32)
    if PREFETCH:
        xn = _row_chunk(X, pid_r * B, end, c64, cmask, stride_xr, stride_xc, SUB)
    for i in range(B // SUB):
        first = pid_r * B + i * SUB
        if PREFETCH:  # the next chunk's load in flight while this one is reduced
            x = xn.to(tl.float32)
            xn = _row_chunk(X, first + SUB, end, c64, cmask, stride_xr, stride_xc, SUB)
        else:
            x = _row_chunk(X, first, end, c64, cmask, stride_xr, stride_xc, SUB).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.max(acc, axis=1), axis=0), FLOOR), FMAX)
    if TRANS and COLS != 2:  # the operand of X^T: [C, R] row-major, by column chunks
        rows = pid_r * B + tl.arange(0, B)
        rmask = rows < R
        r64 = rows.to(tl.int64)
        for j in range(B // SUBC):
            sc = pid_c * B + j * SUBC + tl.arange(0, SUBC)
            scmask = sc < C
            sc64 = sc.to(tl.int64)
            if COLS == 0:  # [SUBC, B]: rows of Q along the first axis
                mask = scmask[:, None] & rmask[None, :]
                x = tl.load(
                    X + r64[None, :] * stride_xr + sc64[:, None] * stride_xc, mask=mask, other=0.0
                ).to(tl.float32)
                q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FMAX), FMAX)
                if ROUND:
                    q = _round_to_grid(q, MANT, MIN_EXP)
                tl.store(Q + sc64[:, None] * R + r64[None, :], q.to(Q.dtype.element_ty), mask=mask)
            else:  # [B, SUBC], transposed before the store
                mask = rmask[:, None] & scmask[None, :]
                x = tl.load(
                    X + r64[:, None] * stride_xr + sc64[None, :] * stride_xc, mask=mask, other=0.0
                ).to(tl.float32)
                q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FMAX), FMAX)
                if ROUND:
                    q = _round_to_grid(q, MANT, MIN_EXP)
                qt = tl.trans(q.to(Q.dtype.element_ty))
                tl.store(Q + sc64[:, None] * R + r64[None, :], qt, mask=tl.trans(mask))
        tl.store(S + pid_c * stride_sr + pid_r, scale)
    else:  # by row chunks: Q [R, C], or with TRANS [C, R] through tl.trans
        if PREFETCH:
            xn = _row_chunk(X, pid_r * B, end, c64, cmask, stride_xr, stride_xc, SUB)
        for i in range(B // SUB):
            first = pid_r * B + i * SUB
            if PREFETCH:
                x = xn.to(tl.float32)
                xn = _row_chunk(X, first + SUB, end, c64, cmask, stride_xr, stride_xc, SUB)
            else:
                x = _row_chunk(X, first, end, c64, cmask, stride_xr, stride_xc, SUB).to(tl.float32)
            rows = first + tl.arange(0, SUB)
            r64 = rows.to(tl.int64)
            mask = (rows[:, None] < R) & cmask[None, :]
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FMAX), FMAX)
            if ROUND:
                q = _round_to_grid(q, MANT, MIN_EXP)
            if TRANS:
                qt = tl.trans(q.to(Q.dtype.element_ty))
                tl.store(Q + c64[:, None] * R + r64[None, :], qt, mask=tl.trans(mask))
            else:
                tl.store(Q + r64[:, None] * C + c64[None, :], q.to(Q.dtype.element_ty), mask=mask)
        if TRANS:
            tl.store(S + pid_c * stride_sr + pid_r, scale)
        else:
            tl.store(S + pid_r * stride_sr + pid_c, scale)


@triton.jit
def _quant_dual_kernel(
    X, Q, S, QT, ST,
    R, C,
    stride_xr, stride_xc, stride_sr, stride_sc, stride_str, stride_stc,
    FMAX: tl.constexpr, FLOOR: tl.constexpr, B: tl.constexpr,
    SUB: tl.constexpr, SUBC: tl.constexpr, COLS: tl.constexpr, PREFETCH: tl.constexpr,
    ROUND: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
):  # fmt: skip
    """Two 1x128 quantisations of a ``[B, B]`` tile of ``X`` ``[R, C]``: along C by
    ``[SUB, B]`` row chunks (``Q`` ``[R, C]``, a scale per row of the tile), then along R,
    written transposed (``QT`` ``[C, R]``, a scale per column of the tile), re-reading the
    tile from L2: by ``[B, SUBC]`` column chunks (``COLS`` 0: read through transposed
    addresses, 1: through ``tl.trans``), or (``COLS`` 2) by the row chunks again with the
    column amax gathered in the first pass."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    cols = pid_c * B + tl.arange(0, B)
    cmask = cols < C
    c64 = cols.to(tl.int64)
    end = tl.minimum(R, pid_r * B + B)
    if COLS == 2:
        acc = tl.zeros([SUB, B], dtype=tl.float32)
    if PREFETCH:
        xn = _row_chunk(X, pid_r * B, end, c64, cmask, stride_xr, stride_xc, SUB)
    for i in range(B // SUB):
        first = pid_r * B + i * SUB
        if PREFETCH:  # the next chunk's load in flight while this one is quantised
            x = xn.to(tl.float32)
            xn = _row_chunk(X, first + SUB, end, c64, cmask, stride_xr, stride_xc, SUB)
        else:
            x = _row_chunk(X, first, end, c64, cmask, stride_xr, stride_xc, SUB).to(tl.float32)
        rows = first + tl.arange(0, SUB)
        rmask = rows < R
        r64 = rows.to(tl.int64)
        mask = rmask[:, None] & cmask[None, :]
        ax = tl.abs(x)
        if COLS == 2:
            acc = tl.maximum(acc, ax)
        s_row = tl.math.div_rn(tl.maximum(tl.max(ax, axis=1), FLOOR), FMAX)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, s_row[:, None]), -FMAX), FMAX)
        if ROUND:
            q = _round_to_grid(q, MANT, MIN_EXP)
        tl.store(Q + r64[:, None] * C + c64[None, :], q.to(Q.dtype.element_ty), mask=mask)
        tl.store(S + r64 * stride_sr + pid_c * stride_sc, s_row, mask=rmask)
    if COLS == 2:
        s_col = tl.math.div_rn(tl.maximum(tl.max(acc, axis=0), FLOOR), FMAX)
        if PREFETCH:
            xn = _row_chunk(X, pid_r * B, end, c64, cmask, stride_xr, stride_xc, SUB)
        for i in range(B // SUB):
            first = pid_r * B + i * SUB
            if PREFETCH:
                x = xn.to(tl.float32)
                xn = _row_chunk(X, first + SUB, end, c64, cmask, stride_xr, stride_xc, SUB)
            else:
                x = _row_chunk(X, first, end, c64, cmask, stride_xr, stride_xc, SUB).to(tl.float32)
            rows = first + tl.arange(0, SUB)
            r64 = rows.to(tl.int64)
            mask = (rows[:, None] < R) & cmask[None, :]
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, s_col[None, :]), -FMAX), FMAX)
            if ROUND:
                q = _round_to_grid(q, MANT, MIN_EXP)
            qt = tl.trans(q.to(QT.dtype.element_ty))
            tl.store(QT + c64[:, None] * R + r64[None, :], qt, mask=tl.trans(mask))
        tl.store(ST + c64 * stride_str + pid_r * stride_stc, s_col, mask=cmask)
    else:
        rows = pid_r * B + tl.arange(0, B)
        rmask = rows < R
        r64 = rows.to(tl.int64)
        for j in range(B // SUBC):
            sc = pid_c * B + j * SUBC + tl.arange(0, SUBC)
            scmask = sc < C
            sc64 = sc.to(tl.int64)
            if COLS == 0:  # [SUBC, B]: a row of QT per row of the chunk
                mask = scmask[:, None] & rmask[None, :]
                x = tl.load(
                    X + r64[None, :] * stride_xr + sc64[:, None] * stride_xc, mask=mask, other=0.0
                ).to(tl.float32)
                s_col = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR), FMAX)
                q = tl.minimum(tl.maximum(tl.math.div_rn(x, s_col[:, None]), -FMAX), FMAX)
                if ROUND:
                    q = _round_to_grid(q, MANT, MIN_EXP)
                tl.store(
                    QT + sc64[:, None] * R + r64[None, :], q.to(QT.dtype.element_ty), mask=mask
                )
            else:  # [B, SUBC], transposed before the store
                mask = rmask[:, None] & scmask[None, :]
                x = tl.load(
                    X + r64[:, None] * stride_xr + sc64[None, :] * stride_xc, mask=mask, other=0.0
                ).to(tl.float32)
                s_col = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), FLOOR), FMAX)
                q = tl.minimum(tl.maximum(tl.math.div_rn(x, s_col[None, :]), -FMAX), FMAX)
                if ROUND:
                    q = _round_to_grid(q, MANT, MIN_EXP)
                qt = tl.trans(q.to(QT.dtype.element_ty))
                tl.store(QT + sc64[:, None] * R + r64[None, :], qt, mask=tl.trans(mask))
            tl.store(ST + sc64 * stride_str + pid_r * stride_stc, s_col, mask=scmask)


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
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FMAX), FMAX)
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
    x: Tensor,
    scale: Tensor,
    dtype: torch.dtype,
    fmax: float,
    floor: float,
    config: TileConfig | None = None,
) -> Tensor:
    """The ``128x128`` quantisation of ``x^T`` from ``x`` ``[R, C]`` read row by row: the FP8
    ``[C, R]`` data (returned) and its scales written into ``scale`` (``[ceil(C/128),
    ceil(R/128)]``, the 128x128 layout of ``x^T``). Same codes and scales as quantising
    ``x.t()``, without its strided reads. ``config``: ``BLOCKS_T_CONFIG`` unless given."""
    rows, cols = x.shape
    q = torch.empty(cols, rows, device=x.device, dtype=dtype)
    if rows == 0 or cols == 0:
        return q
    grid = (triton.cdiv(rows, 128), triton.cdiv(cols, 128))
    _quant_blocks_kernel[grid](
        x, q, scale, rows, cols, x.stride(0), x.stride(1), scale.stride(0),
        FMAX=fmax, FLOOR=floor, B=_TILE, TRANS=True, **(config or BLOCKS_T_CONFIG).kernel_args(),
        **_grid_args(dtype),
    )  # fmt: skip
    return q


def quantize_dual_triton(
    x: Tensor,
    scale: Tensor,
    scale_t: Tensor,
    dtype: torch.dtype,
    fmax: float,
    floor: float,
    config: TileConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """The 1x128 quantisations of ``x`` ``[R, C]`` along C and of ``x^T`` along R in one
    pass: ``(data [R, C], data_t [C, R])``, the scales written into ``scale`` (``[R,
    ceil(C/128)]``) and ``scale_t`` (``[C, ceil(R/128)]``) in the 1x128 layout. ``config``:
    ``DUAL_CONFIG`` unless given."""
    rows, cols = x.shape
    q = torch.empty(rows, cols, device=x.device, dtype=dtype)
    qt = torch.empty(cols, rows, device=x.device, dtype=dtype)
    if rows == 0 or cols == 0:
        return q, qt
    grid = (triton.cdiv(rows, 128), triton.cdiv(cols, 128))
    _quant_dual_kernel[grid](
        x, q, scale, qt, scale_t, rows, cols, x.stride(0), x.stride(1),
        scale.stride(0), scale.stride(1), scale_t.stride(0), scale_t.stride(1),
        FMAX=fmax, FLOOR=floor, B=_TILE, **(config or DUAL_CONFIG).kernel_args(),
        **_grid_args(dtype),
    )  # fmt: skip
    return q, qt


def quantize_triton(
    x: Tensor,
    scale: Tensor,
    granularity: str,
    dtype: torch.dtype,
    fmax: float,
    floor: float,
    config: TileConfig | None = None,
) -> Tensor:
    """Quantise ``x`` ``[R, C]`` into a new row-major FP8 tensor, writing the scales into
    ``scale`` (allocated by the caller in the granularity's layout); returns the data.
    ``config``: the 128x128 kernel's (``BLOCKS_CONFIG`` unless given)."""
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
            FMAX=fmax, FLOOR=floor, B=_TILE, TRANS=False,
            **(config or BLOCKS_CONFIG).kernel_args(), **grid_args,
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
    "BLOCKS_CONFIG",
    "BLOCKS_T_CONFIG",
    "DUAL_CONFIG",
    "TILE_CONFIGS",
    "TileConfig",
    "fp8_quantize_blocks_t_eager",
    "fp8_quantize_dual_eager",
    "fp8_quantize_eager",
    "quantize_blocks_transposed_triton",
    "quantize_dual_triton",
    "quantize_triton",
]
