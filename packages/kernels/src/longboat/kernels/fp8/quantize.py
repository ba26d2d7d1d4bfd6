"""FP8 quantisation of GEMM operands: torch references, the Triton kernels' dispatch.

Every GEMM operand is a row-major ``[rows, K]`` matrix quantised along K, the contraction
dimension (an ``Fp8Operand``): ``x ~= data * scale`` with ``data`` in FP8 and ``scale`` fp32
(the dequantisation factor, ``amax / fp8_max`` of its group, so the group's largest value
lands on the format's largest finite value). Granularities:

- ``tensor``: one scale for the matrix (``scale`` 0-dim);
- ``row``: one scale per row (``scale`` ``[rows, 1]``, contiguous);
- ``1x128``: one scale per row and 128 consecutive K elements (DeepSeek-V3's activation
  tiles); ``scale`` ``[rows, ceil(K / 128)]`` stored K-block-major (strides ``(1, rows)``),
  the layout cuBLAS reads for 1x128 scales;
- ``128x128``: one scale per 128 x 128 block (DeepSeek-V3's weight blocks); ``scale``
  ``[ceil(rows / 128), ceil(K / 128)]`` as the leading columns of a row-major buffer whose
  row length is ``ceil(K / 128)`` rounded up to 4 (cuBLAS's padding for 128x128 scales;
  ``gemm_scale`` hands it over). A tail block (rows or K not a multiple of 128) is scaled
  by the amax of the elements it has.

A group of zeros gets the scale ``AMAX_FLOOR / fp8_max`` and quantises to zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longboat.kernels._dispatch import resolve_impl

Tensor = torch.Tensor
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
BLOCK = 128
"""Side of the blockwise tiles (1x128 activations, 128x128 weights)."""
GRANULARITIES = ("tensor", "row", "1x128", "128x128")
AMAX_FLOOR = 1e-12
"""Smallest amax a scale is computed from (a group of zeros)."""
ROWWISE_TRITON_MAX = 16384
"""Longest row the Triton rowwise kernel takes in one tile; longer rows use the reference."""


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format (448 for e4m3fn, 57344 for e5m2)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{dtype} is not an FP8 format; use {E4M3} or {E5M2}")
    return float(torch.finfo(dtype).max)


def padded_blocks(n: int) -> int:
    """``ceil(n / 128)`` rounded up to a multiple of 4: the row length of a 128x128 scale
    buffer."""
    return -(-math.ceil(n / BLOCK) // 4) * 4


@dataclass(frozen=True)
class Fp8Operand:
    """A GEMM operand ``[rows, K]`` in FP8 with the fp32 scales that dequantise it."""

    data: Tensor
    """``[rows, K]`` FP8, row-major contiguous."""
    scale: Tensor
    """fp32 scales in the layout of ``granularity`` (module doc)."""
    granularity: str
    """``tensor``, ``row``, ``1x128`` or ``128x128``."""

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def expanded_scale(self) -> Tensor:
        """The scale of every element, ``[rows, K]`` fp32."""
        rows, k = self.data.shape
        s = self.scale
        if self.granularity == "tensor":
            return s.reshape(1, 1).expand(rows, k)
        if self.granularity == "row":
            return s.reshape(rows, 1).expand(rows, k)
        if self.granularity == "1x128":
            return s.repeat_interleave(BLOCK, dim=1)[:, :k]
        return s.repeat_interleave(BLOCK, dim=0)[:rows].repeat_interleave(BLOCK, dim=1)[:, :k]

    def dequantize(self) -> Tensor:
        """``data * scale`` in fp32."""
        return self.data.float() * self.expanded_scale()

    def gemm_scale(self) -> Tensor:
        """The scale tensor in the shape and strides cuBLAS reads for this operand as either
        GEMM side (``torch.nn.functional.scaled_mm``; see ``gemm.py``)."""
        if self.granularity == "128x128":
            rb = self.scale.shape[0]
            lead = self.scale.stride(0)  # the padded row length
            return self.scale.as_strided((lead, rb), (1, lead))
        return self.scale


def scale_storage_shape(rows: int, k: int, granularity: str) -> tuple[int, ...]:
    """Shape of the buffer holding the scales of a ``[rows, K]`` operand (module doc)."""
    kb = math.ceil(k / BLOCK)
    if granularity == "tensor":
        return ()
    if granularity == "row":
        return (rows, 1)
    if granularity == "1x128":
        return (kb, rows)
    return (math.ceil(rows / BLOCK), padded_blocks(k))


def scale_view(storage: Tensor, granularity: str, k: int) -> Tensor:
    """The logical scale tensor of ``Fp8Operand.scale`` on its buffer."""
    if granularity == "1x128":
        return storage.t()
    if granularity == "128x128":
        return storage[:, : math.ceil(k / BLOCK)]
    return storage


def _empty_scale(rows: int, k: int, granularity: str, device: torch.device) -> Tensor:
    make = torch.zeros if granularity == "128x128" else torch.empty  # padding stays defined
    storage = make(scale_storage_shape(rows, k, granularity), device=device, dtype=torch.float32)
    return scale_view(storage, granularity, k)


def _check(x: Tensor, granularity: str, dtype: torch.dtype) -> None:
    if x.dim() != 2:
        raise ValueError(
            f"FP8 quantisation takes a 2-D [rows, K] matrix, got shape {tuple(x.shape)}"
        )
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}: expected one of {GRANULARITIES}")
    fp8_max(dtype)


def quantize_torch(x: Tensor, granularity: str, dtype: torch.dtype = E4M3) -> Fp8Operand:
    """Pure-torch reference of :func:`quantize` (same scales, same FP8 codes)."""
    _check(x, granularity, dtype)
    rows, k = x.shape
    fmax = fp8_max(dtype)
    xf = x.float()
    out = _empty_scale(rows, k, granularity, x.device)
    if granularity == "tensor":
        scale = xf.abs().amax().clamp(min=AMAX_FLOOR) / fmax
        q = (xf / scale).clamp(-fmax, fmax).to(dtype)
        out.copy_(scale)
        return Fp8Operand(q, out, granularity)
    if granularity == "row":
        scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=AMAX_FLOOR) / fmax
        q = (xf / scale).clamp(-fmax, fmax).to(dtype)
        out.copy_(scale)
        return Fp8Operand(q, out, granularity)
    kb = math.ceil(k / BLOCK)
    xp = F.pad(xf, (0, kb * BLOCK - k))
    if granularity == "1x128":
        tiles = xp.view(rows, kb, BLOCK)
        scale = tiles.abs().amax(dim=2).clamp(min=AMAX_FLOOR) / fmax  # [rows, kb]
        q = (tiles / scale[:, :, None]).clamp(-fmax, fmax).to(dtype).view(rows, -1)[:, :k]
        out.copy_(scale)
        return Fp8Operand(q.contiguous(), out, granularity)
    rb = math.ceil(rows / BLOCK)
    xp = F.pad(xp, (0, 0, 0, rb * BLOCK - rows))
    blocks = xp.view(rb, BLOCK, kb, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR) / fmax  # [rb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-fmax, fmax).to(dtype)
    q = q.view(rb * BLOCK, kb * BLOCK)[:rows, :k]
    out.copy_(scale)
    return Fp8Operand(q.contiguous(), out, granularity)


def quantize(
    x: Tensor, granularity: str, dtype: torch.dtype = E4M3, impl: str | None = None
) -> Fp8Operand:
    """Quantise ``x`` ``[rows, K]`` (any strides: a transposed view is read in place) to an
    ``Fp8Operand`` of ``granularity`` in FP8 format ``dtype``, amax, scale and cast fused in
    one pass per tile (Triton on CUDA, the torch reference elsewhere; ``impl`` as in
    ``longboat.kernels``). ``tensor`` takes its amax in a torch reduction first. The Triton
    path is the custom op ``torch.ops.longboat.fp8_quantize`` (with a fake implementation)
    while torch.compile traces."""
    _check(x, granularity, dtype)
    if resolve_impl(impl, x) == "torch" or (
        granularity == "row" and x.shape[1] > ROWWISE_TRITON_MAX
    ):
        return quantize_torch(x, granularity, dtype)
    from longboat.kernels._dispatch import op
    from longboat.kernels.fp8.quantize_triton import fp8_quantize_eager

    data, storage = op("fp8_quantize", fp8_quantize_eager)(x, granularity, dtype)
    return Fp8Operand(data, scale_view(storage, granularity, x.shape[1]), granularity)


def quantize_dual(
    x: Tensor, dtype: torch.dtype = E4M3, impl: str | None = None
) -> tuple[Fp8Operand, Fp8Operand]:
    """The ``1x128`` operands of ``x`` ``[rows, K]`` (along K) and of ``x^T`` (along the
    rows), equal to ``quantize(x, "1x128")`` and ``quantize(x.t(), "1x128")``; on the Triton
    path one kernel reads each 128 x 128 tile once and writes both (the second transposed)."""
    _check(x, "1x128", dtype)
    if resolve_impl(impl, x) == "torch":
        return quantize_torch(x, "1x128", dtype), quantize_torch(x.t(), "1x128", dtype)
    from longboat.kernels._dispatch import op
    from longboat.kernels.fp8.quantize_triton import fp8_quantize_dual_eager

    rows, k = x.shape
    data, storage, data_t, storage_t = op("fp8_quantize_dual", fp8_quantize_dual_eager)(x, dtype)
    return (
        Fp8Operand(data, scale_view(storage, "1x128", k), "1x128"),
        Fp8Operand(data_t, scale_view(storage_t, "1x128", rows), "1x128"),
    )


def quantize_blocks_transposed(
    x: Tensor, dtype: torch.dtype = E4M3, impl: str | None = None
) -> Fp8Operand:
    """``quantize(x.t(), "128x128")`` (a weight's operand for the input-gradient GEMM) with
    ``x`` read row by row and the codes written transposed on the Triton path."""
    _check(x, "128x128", dtype)
    if resolve_impl(impl, x) == "torch":
        return quantize_torch(x.t(), "128x128", dtype)
    from longboat.kernels._dispatch import op
    from longboat.kernels.fp8.quantize_triton import fp8_quantize_blocks_t_eager

    data, storage = op("fp8_quantize_blocks_t", fp8_quantize_blocks_t_eager)(x, dtype)
    return Fp8Operand(data, scale_view(storage, "128x128", x.shape[0]), "128x128")


def transpose_blockwise(op: Fp8Operand) -> Fp8Operand:
    """The ``128x128`` operand of ``W^T`` from that of ``W``: the same blocks, so the same
    codes and scales, transposed (the data copied row-major)."""
    if op.granularity != "128x128":
        raise ValueError(f"transpose_blockwise takes a 128x128 operand, got {op.granularity}")
    rows, k = op.data.shape
    scale = _empty_scale(k, rows, "128x128", op.data.device)
    scale.copy_(op.scale.t())
    return Fp8Operand(op.data.t().contiguous(), scale, "128x128")


__all__ = [
    "AMAX_FLOOR",
    "BLOCK",
    "E4M3",
    "E5M2",
    "GRANULARITIES",
    "Fp8Operand",
    "fp8_max",
    "padded_blocks",
    "quantize",
    "quantize_blocks_transposed",
    "quantize_dual",
    "quantize_torch",
    "scale_storage_shape",
    "scale_view",
    "transpose_blockwise",
]
