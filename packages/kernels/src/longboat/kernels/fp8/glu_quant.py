"""A gated linear unit that writes its output as the next linear's FP8 operands.

In an MLP, ``a = act(gate) * up`` feeds only the down projection (fc2). Unfused, the GLU
kernel writes ``a`` in bf16 and the FP8 linear reads it back to quantise it (``x`` along K
for the forward GEMM, ``x^T`` along the tokens for the weight gradient): two bytes written
and read again per value. ``glu_quantize_dual`` computes ``a`` tile by tile and quantises it
where it is, writing only the two 1x128 FP8 operands and their scales.

Numerics: the tile is rounded to the GLU's output dtype (what the unfused kernel stores)
before it is quantised, by the same activation code (``swiglu._act_and_grad``) and the same
quantisation code (``quantize_triton._dual_tile_store``) as the unfused kernels, so the
codes and scales equal those of ``quantize_dual(glu(h))`` bit for bit.
"""

from __future__ import annotations

import torch

from longboat.kernels._dispatch import op, resolve_impl
from longboat.kernels._triton import tl, triton
from longboat.kernels.fp8.quantize import (
    AMAX_FLOOR,
    E4M3,
    Fp8Operand,
    fp8_max,
    quantize_dual,
    scale_storage_shape,
    scale_view,
)
from longboat.kernels.fp8.quantize_triton import _dual_tile_store, _grid_args
from longboat.kernels.swiglu import _ACTS, _act_and_grad, glu

Tensor = torch.Tensor
GLU_QUANT_WARPS = 16
"""Warps of ``_glu_quant_dual_kernel``'s 128 x 128 tile. The activation's exact sigmoid
(an IEEE division per value) on top of the two quantisations overflows the registers of 8
warps (Triton 3.9, sm_90: 255 registers and 680 bytes of stack a thread, against 64 for
``_quant_dual_kernel``); 16 warps hold half the values a thread (128 registers, 152 bytes
of stack, as ``_quant_dual_kernel`` at 16 warps)."""


@triton.jit
def _glu_quant_dual_kernel(
    H, Q, S, QT, ST,
    R, C,
    stride_h, stride_sr, stride_sc, stride_str, stride_stc,
    ACT: tl.constexpr, FMAX: tl.constexpr, FLOOR: tl.constexpr, B: tl.constexpr,
    ROUND: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
):  # fmt: skip
    """A ``[B, B]`` tile of ``act(gate) * up`` from the packed ``H`` ``[R, 2C]`` (gate first),
    rounded to H's dtype and quantised 1x128 along C (``Q``) and along R (``QT`` ``[C, R]``)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * B + tl.arange(0, B)
    cols = pid_c * B + tl.arange(0, B)
    rmask = rows < R
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    ptr = H + rows.to(tl.int64)[:, None] * stride_h + cols.to(tl.int64)[None, :]
    g = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(ptr + C, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    x = (a * u).to(H.dtype.element_ty).to(tl.float32)  # the value the unfused GLU stores
    _dual_tile_store(
        x, rows, cols, rmask, cmask, pid_r, pid_c, Q, S, QT, ST, R, C,
        stride_sr, stride_sc, stride_str, stride_stc,
        FMAX=FMAX, FLOOR=FLOOR, ROUND=ROUND, MANT=MANT, MIN_EXP=MIN_EXP,
    )  # fmt: skip


def _packed_rows(h: Tensor) -> Tensor:
    """``h`` ``[..., 2C]`` as ``[rows, 2C]`` with unit last stride."""
    return h.contiguous().reshape(-1, h.shape[-1])


def fp8_glu_quantize_dual_eager(
    h: Tensor, act: int, dtype: torch.dtype, num_warps: int = GLU_QUANT_WARPS
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(data, scale buffer, data_t, scale_t buffer)``: the 1x128 operands of
    ``a = act(gate) * up`` ``[R, C]`` and of ``a^T`` from the packed ``h`` ``[..., 2C]``
    (``quantize.scale_view`` gives each scale tensor); ``num_warps`` of the kernel's tile."""
    h2 = _packed_rows(h)
    rows, c = h2.shape[0], h2.shape[1] // 2
    storage = torch.empty(
        scale_storage_shape(rows, c, "1x128"), device=h.device, dtype=torch.float32
    )
    storage_t = torch.empty(
        scale_storage_shape(c, rows, "1x128"), device=h.device, dtype=torch.float32
    )
    q = torch.empty(rows, c, device=h.device, dtype=dtype)
    qt = torch.empty(c, rows, device=h.device, dtype=dtype)
    if rows == 0 or c == 0:
        return q, storage, qt, storage_t
    scale, scale_t = scale_view(storage, "1x128", c), scale_view(storage_t, "1x128", rows)
    grid = (triton.cdiv(rows, 128), triton.cdiv(c, 128))
    _glu_quant_dual_kernel[grid](
        h2, q, scale, qt, scale_t, rows, c, h2.stride(0),
        scale.stride(0), scale.stride(1), scale_t.stride(0), scale_t.stride(1),
        ACT=act, FMAX=fp8_max(dtype), FLOOR=AMAX_FLOOR, B=128, num_warps=num_warps,
        **_grid_args(dtype),
    )  # fmt: skip
    return q, storage, qt, storage_t


_fp8_glu_quantize_dual = torch.library.custom_op(
    "longboat::fp8_glu_quantize_dual", mutates_args=()
)(fp8_glu_quantize_dual_eager)


@_fp8_glu_quantize_dual.register_fake
def _(
    h: Tensor, act: int, dtype: torch.dtype, num_warps: int = GLU_QUANT_WARPS
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rows, c = h.numel() // h.shape[-1], h.shape[-1] // 2
    return (
        h.new_empty((rows, c), dtype=dtype),
        h.new_empty(scale_storage_shape(rows, c, "1x128"), dtype=torch.float32),
        h.new_empty((c, rows), dtype=dtype),
        h.new_empty(scale_storage_shape(c, rows, "1x128"), dtype=torch.float32),
    )


def glu_quantize_dual(
    h: Tensor,
    activation: str = "silu",
    dtype: torch.dtype = E4M3,
    impl: str | None = None,
    *,
    num_warps: int = GLU_QUANT_WARPS,
) -> tuple[Fp8Operand, Fp8Operand]:
    """The ``1x128`` operands of ``a = act(gate) * up`` ``[rows, C]`` (along C) and of ``a^T``
    (along the rows) from the packed ``h`` ``[..., 2C]`` (gate first; ``activation`` as in
    ``swiglu.glu``), equal to ``quantize_dual(glu(h, activation=activation))``. On the Triton
    path one kernel reads gate and up and writes only the FP8 operands (module doc); the
    torch path runs exactly that unfused composition. ``num_warps``: the Triton kernel's
    (``GLU_QUANT_WARPS``; the benchmark compares others)."""
    if activation not in _ACTS:
        raise ValueError(f"glu_quantize_dual: activation={activation!r} is not one of {_ACTS}")
    if h.shape[-1] % 2:
        raise ValueError(f"glu_quantize_dual: packed gate/up needs an even last dim, got {h.shape[-1]}")  # fmt: skip
    fp8_max(dtype)
    if resolve_impl(impl, h) == "torch":
        a = glu(h, activation=activation, impl="torch")
        return quantize_dual(a.reshape(-1, a.shape[-1]), dtype, impl="torch")
    c = h.shape[-1] // 2
    data, storage, data_t, storage_t = op("fp8_glu_quantize_dual", fp8_glu_quantize_dual_eager)(
        h, _ACTS.index(activation), dtype, num_warps
    )
    rows = data.shape[0]
    return (
        Fp8Operand(data, scale_view(storage, "1x128", c), "1x128"),
        Fp8Operand(data_t, scale_view(storage_t, "1x128", rows), "1x128"),
    )


__all__ = ["GLU_QUANT_WARPS", "fp8_glu_quantize_dual_eager", "glu_quantize_dual"]
