"""Gated residual update of a DiT block: ``x + y * gate`` with a per-sample ``gate``.

As Wan / FLUX blocks use it after attention and the MLP: ``x`` (the residual stream) and
``y`` (the sublayer output) are ``[batch, seq, hidden]``, ``gate`` is per sample
(``[batch, hidden]`` or ``[batch, 1, hidden]``, usually fp32). Math in fp32, output in x's
dtype. Forward reads ``x`` and ``y`` once and writes the sum; backward reads ``dout`` and
``y`` once, writes ``dy`` and per-(sample, token block) fp32 partial sums of ``dout * y``
that a small torch sum turns into ``dgate``: no atomics, so ``dgate`` is bit for bit the
same on every run. ``dx`` is ``dout`` itself (no kernel).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from longboat.kernels._dispatch import op, resolve_impl
from longboat.kernels._triton import next_pow2, tl, triton

Tensor = torch.Tensor

# Tile shapes, swept on an H200 at 100k tokens and hidden 1536 / 3072 (bf16): the forward
# streams at ~97% of the device-to-device copy rate with 4096-element tiles up to 512
# channels wide; the backward, which also reduces over tokens, does best (83-86%) with
# 8192-element tiles 128 channels wide (64 tokens a step), 8 steps a program (one tile a
# program measured ~2x slower), split further where that leaves under 2 programs an SM.
_FWD_TILE, _FWD_MAX_BLOCK_D = 4096, 512
_BWD_TILE, _BWD_MAX_BLOCK_D, _BWD_STEPS = 8192, 128, 8
_NUM_WARPS = 4
# A constant, not the device's SM count (132 on an H100 / H200), so the token partition,
# and so dgate's bits, do not depend on which GPU runs it. The interpreter gets a handful.
_BWD_MIN_PROGRAMS = {"cuda": 264}
_BWD_MIN_PROGRAMS_DEFAULT = 4


def gated_residual_torch(x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
    """Pure-torch reference of :func:`gated_residual` (fp32 math, output in x's dtype)."""
    b, _, d = x.shape
    return (x.float() + y.float() * gate.float().reshape(b, 1, d)).to(x.dtype)


@triton.jit
def _tile_ptrs(BASE, sample, row0, stride_b, stride_s, rows, cols):
    """Pointers of a [rows, cols] tile starting at token ``row0`` of ``sample``: int64
    per-program base (b * s * d passes 2**31 at 100k tokens of a few samples), int32
    offsets inside the tile."""
    base = BASE + sample * stride_b + row0 * stride_s
    return base + rows[:, None] * stride_s + cols[None, :]


@triton.jit
def _gated_residual_fwd_kernel(
    X, Y, G, OUT,
    stride_xb, stride_xs, stride_yb, stride_ys, stride_gb, stride_ob, stride_os,
    S, D, tiles_per_sample,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    sample = (pid // tiles_per_sample).to(tl.int64)
    row0 = ((pid % tiles_per_sample) * BLOCK_S).to(tl.int64)
    rows = tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = ((row0 + rows) < S)[:, None] & cmask[None, :]
    g = tl.load(G + sample * stride_gb + cols, mask=cmask, other=0.0).to(tl.float32)
    x_ptr = _tile_ptrs(X, sample, row0, stride_xb, stride_xs, rows, cols)
    y_ptr = _tile_ptrs(Y, sample, row0, stride_yb, stride_ys, rows, cols)
    o_ptr = _tile_ptrs(OUT, sample, row0, stride_ob, stride_os, rows, cols)
    x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr, (x + y * g[None, :]).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_residual_bwd_kernel(
    DO, Y, G, DY, DG_PART,
    stride_db, stride_ds, stride_yb, stride_ys, stride_gb, stride_dyb, stride_dys,
    S, D, rows_per_prog, blocks_per_sample,
    NEED_DY: tl.constexpr, NEED_DG: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    sample = (pid // blocks_per_sample).to(tl.int64)
    row_start = ((pid % blocks_per_sample) * rows_per_prog).to(tl.int64)
    rows = tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    g = tl.load(G + sample * stride_gb + cols, mask=cmask, other=0.0).to(tl.float32)
    do_ptr = _tile_ptrs(DO, sample, row_start, stride_db, stride_ds, rows, cols)
    y_ptr = _tile_ptrs(Y, sample, row_start, stride_yb, stride_ys, rows, cols)
    dy_ptr = _tile_ptrs(DY, sample, row_start, stride_dyb, stride_dys, rows, cols)
    # Per-lane fp32 sums over the token steps, reduced across the tile once at the end.
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    for r in range(0, rows_per_prog, BLOCK_S):
        mask = ((row_start + r + rows) < S)[:, None] & cmask[None, :]
        do = tl.load(do_ptr, mask=mask, other=0.0).to(tl.float32)
        if NEED_DY:
            tl.store(dy_ptr, (do * g[None, :]).to(DY.dtype.element_ty), mask=mask)
        if NEED_DG:
            acc += do * tl.load(y_ptr, mask=mask, other=0.0).to(tl.float32)
        do_ptr += BLOCK_S * stride_ds
        y_ptr += BLOCK_S * stride_ys
        dy_ptr += BLOCK_S * stride_dys
    if NEED_DG:
        tl.store(DG_PART + pid.to(tl.int64) * D + cols, tl.sum(acc, axis=0), mask=cmask)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shapes and grids of both kernels for one ``[b, s, d]`` input.

    Forward: one program per ``fwd_block_s`` x ``fwd_block_d`` tile. Backward: one program
    per (sample, block of ``rows_per_prog`` tokens, ``bwd_block_d`` channels), stepping
    through its tokens ``bwd_block_s`` at a time and writing one fp32 partial row of dgate;
    ``blocks_per_sample`` such rows per sample.
    """

    fwd_block_s: int
    fwd_block_d: int
    fwd_grid: tuple[int, int]
    bwd_block_s: int
    bwd_block_d: int
    rows_per_prog: int
    blocks_per_sample: int
    bwd_grid: tuple[int, int]
    num_warps: int


def _cdiv(a: int, b: int) -> int:
    # Plain ceil-division: triton.cdiv costs over a microsecond a call.
    return -(-a // b)


@functools.lru_cache(maxsize=256)
def launch_config(b: int, s: int, d: int, device: torch.device) -> LaunchConfig:
    """The :class:`LaunchConfig` of ``[b, s, d]`` inputs on ``device`` (cached: it is asked
    for on every call)."""
    fwd_d = min(next_pow2(d), _FWD_MAX_BLOCK_D)
    fwd_s = max(1, min(_FWD_TILE // fwd_d, next_pow2(s)))
    bwd_d = min(next_pow2(d), _BWD_MAX_BLOCK_D)
    bwd_s = max(1, min(_BWD_TILE // bwd_d, next_pow2(s)))
    bwd_col_blocks = _cdiv(d, bwd_d)
    min_programs = _BWD_MIN_PROGRAMS.get(device.type, _BWD_MIN_PROGRAMS_DEFAULT)
    chunks = max(_cdiv(s, _BWD_STEPS * bwd_s), _cdiv(min_programs, max(b * bwd_col_blocks, 1)))
    chunks = max(1, min(chunks, _cdiv(s, bwd_s)))
    rows_per_prog = _cdiv(_cdiv(s, chunks), bwd_s) * bwd_s
    blocks = _cdiv(s, rows_per_prog) if s > 0 else 0
    return LaunchConfig(
        fwd_block_s=fwd_s,
        fwd_block_d=fwd_d,
        fwd_grid=(b * _cdiv(s, fwd_s), _cdiv(d, fwd_d)),
        bwd_block_s=bwd_s,
        bwd_block_d=bwd_d,
        rows_per_prog=rows_per_prog,
        blocks_per_sample=blocks,
        bwd_grid=(b * blocks, bwd_col_blocks),
        num_warps=_NUM_WARPS,
    )


def _unit_last(t: Tensor) -> Tensor:
    """``t`` itself when its channels are contiguous (any batch / token strides, slices and
    broadcasts included), else a contiguous copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _gated_residual_fwd_impl(x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
    b, s, d = x.shape
    x, y, gate = _unit_last(x), _unit_last(y), _unit_last(gate)
    out = torch.empty((b, s, d), device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    cfg = launch_config(b, s, d, x.device)
    _gated_residual_fwd_kernel[cfg.fwd_grid](
        x, y, gate, out,
        x.stride(0), x.stride(1), y.stride(0), y.stride(1), gate.stride(0),
        out.stride(0), out.stride(1),
        s, d, _cdiv(s, cfg.fwd_block_s),
        BLOCK_S=cfg.fwd_block_s, BLOCK_D=cfg.fwd_block_d, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


_gated_residual_fwd = torch.library.custom_op("longboat::gated_residual_fwd", mutates_args=())(
    _gated_residual_fwd_impl
)


@_gated_residual_fwd.register_fake
def _(x: Tensor, y: Tensor, gate: Tensor):
    return x.new_empty(x.shape)


def _gated_residual_bwd_impl(
    dout: Tensor, y: Tensor, gate: Tensor, need_dy: bool, need_dgate: bool
) -> tuple[Tensor, Tensor]:
    b, s, d = y.shape
    dout, y, gate = _unit_last(dout), _unit_last(y), _unit_last(gate)
    dy = torch.empty((b, s, d), device=y.device, dtype=y.dtype) if need_dy else y.new_empty(0)
    cfg = launch_config(b, s, d, y.device)
    blocks = cfg.blocks_per_sample
    parts = torch.empty(
        (b, blocks, d) if need_dgate else (1,), device=y.device, dtype=torch.float32
    )
    dy_arg = dy if need_dy else y  # never written without need_dy
    if b * s * d > 0 and (need_dy or need_dgate):
        _gated_residual_bwd_kernel[cfg.bwd_grid](
            dout, y, gate, dy_arg, parts,
            dout.stride(0), dout.stride(1), y.stride(0), y.stride(1), gate.stride(0),
            dy_arg.stride(0), dy_arg.stride(1),
            s, d, cfg.rows_per_prog, blocks,
            NEED_DY=need_dy, NEED_DG=need_dgate,
            BLOCK_S=cfg.bwd_block_s, BLOCK_D=cfg.bwd_block_d, num_warps=cfg.num_warps,
        )  # fmt: skip
    # An empty sequence sums to zeros: ``parts`` is then [b, 0, d].
    dgate = parts.sum(1).to(gate.dtype) if need_dgate else gate.new_empty(0)
    return dy, dgate


_gated_residual_bwd = torch.library.custom_op("longboat::gated_residual_bwd", mutates_args=())(
    _gated_residual_bwd_impl
)


@_gated_residual_bwd.register_fake
def _(dout: Tensor, y: Tensor, gate: Tensor, need_dy: bool, need_dgate: bool):
    dy = y.new_empty(y.shape) if need_dy else y.new_empty(0)
    dgate = gate.new_empty(gate.shape) if need_dgate else gate.new_empty(0)
    return dy, dgate


class _GatedResidualFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, gate):  # type: ignore[override]
        out = op("gated_residual_fwd", _gated_residual_fwd_impl)(x, y, gate)
        # x is not needed backward: only y (for dgate) and the gate (for dy) are kept.
        ctx.save_for_backward(y, gate)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        y, gate = ctx.saved_tensors
        _, need_dy, need_dgate = ctx.needs_input_grad
        dy = dgate = None
        if need_dy or need_dgate:
            dy, dgate = op("gated_residual_bwd", _gated_residual_bwd_impl)(
                dout, y, gate, need_dy, need_dgate
            )
        dx = dout.to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return dx, dy if need_dy else None, dgate if need_dgate else None


def gated_residual_triton(x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
    """Triton gated residual (fwd + bwd), same signature as :func:`gated_residual_torch`."""
    b, _, d = x.shape
    # A [b, 1, d] gate goes in as a view: autograd hands its gradient back in that shape.
    return _GatedResidualFn.apply(x, y, gate.reshape(b, d))


def gated_residual(x: Tensor, y: Tensor, gate: Tensor, *, impl: str | None = None) -> Tensor:
    """``x + y * gate`` with a per-sample ``gate`` (``[batch, hidden]`` or
    ``[batch, 1, hidden]``) over ``[batch, seq, hidden]`` ``x`` / ``y``; fp32 math, output
    in x's dtype, ``dgate`` in the gate's dtype."""
    if x.dim() != 3:
        raise ValueError(
            f"gated_residual: x must be [batch, seq, hidden], got shape {tuple(x.shape)}; "
            "add a seq dim of 1 for one token per sample"
        )
    if y.shape != x.shape:
        raise ValueError(
            f"gated_residual: y shape {tuple(y.shape)} must equal x shape {tuple(x.shape)}"
        )
    b, _, d = x.shape
    if gate.shape not in ((b, d), (b, 1, d)):
        raise ValueError(
            f"gated_residual: gate shape {tuple(gate.shape)} must be ({b}, {d}) or "
            f"({b}, 1, {d}) for x of shape {tuple(x.shape)}"
        )
    for name, t in (("x", x), ("y", y), ("gate", gate)):
        if not t.is_floating_point():
            raise ValueError(f"gated_residual: {name} must be floating point, got {t.dtype}")
    if resolve_impl(impl, x, y, gate) == "torch":
        return gated_residual_torch(x, y, gate)
    return gated_residual_triton(x, y, gate)
