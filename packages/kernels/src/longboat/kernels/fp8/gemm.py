"""The FP8 GEMM ``out[M, N] = A[M, K] @ B[N, K]^T`` of two ``Fp8Operand`` s.

Backends:

- ``scaled_mm`` (CUDA): ``torch.nn.functional.scaled_mm`` (cuBLASLt), fp32 accumulation
  (``fast_accum=False``). B is handed over as ``B.data.t()``, the column-major ``[K, N]``
  cuBLAS wants, with no copy. The scale pairs this torch accepts on sm90 (from its
  ``ScaledBlas.cpp`` checks; the blockwise ones need CUDA >= 12.9 and compute capability 9.x):
  ``tensor x tensor``, ``row x row``, ``1x128 x 128x128``, ``1x128 x 1x128`` and
  ``128x128 x 1x128``; K and N multiples of 16. ``Fp8Operand.gemm_scale`` gives each scale
  in the strides those checks ask for (1x128: ``(1, rows)``; 128x128: the transposed view of
  the buffer padded to 4 K-blocks). Where ``F.scaled_mm`` is missing (torch before 2.10),
  ``torch._scaled_mm`` takes the same scale tensors and infers each scaling from their shapes.
- ``emulated`` (any device): both operands dequantised to fp32 and multiplied in fp32; the
  reference the CUDA path is checked against, and the path tests take on CPU.

``resolve_gemm_backend`` picks ``scaled_mm`` for CUDA tensors and ``emulated`` elsewhere
(``LONGBOAT_FP8_GEMM`` forces one).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from longboat.kernels.fp8.quantize import Fp8Operand

Tensor = torch.Tensor
GEMM_BACKENDS = ("auto", "scaled_mm", "emulated")
ENV_VAR = "LONGBOAT_FP8_GEMM"
SCALED_MM_PAIRS = {
    ("tensor", "tensor"),
    ("row", "row"),
    ("1x128", "128x128"),
    ("1x128", "1x128"),
    ("128x128", "1x128"),
}
"""The (A, B) scale granularities ``scaled_mm`` takes on sm90."""
_SCALING = {"tensor": "TensorWise", "row": "RowWise", "1x128": "BlockWise1x128",
            "128x128": "BlockWise128x128"}  # fmt: skip


def resolve_gemm_backend(backend: str | None, *tensors: Tensor) -> str:
    """``scaled_mm`` or ``emulated`` (``backend`` > ``LONGBOAT_FP8_GEMM`` > by device)."""
    choice = backend or os.environ.get(ENV_VAR) or "auto"
    if choice not in GEMM_BACKENDS:
        raise ValueError(f"FP8 GEMM backend {choice!r}: expected one of {GEMM_BACKENDS}")
    if choice == "auto":
        return "scaled_mm" if all(t.is_cuda for t in tensors) else "emulated"
    if choice == "scaled_mm" and not all(t.is_cuda for t in tensors):
        raise ValueError("the scaled_mm FP8 GEMM runs on CUDA tensors; use backend='emulated'")
    return choice


def emulated_mm(
    a: Fp8Operand, b: Fp8Operand, *, out_dtype: torch.dtype, bias: Tensor | None = None
) -> Tensor:
    """``dequant(a) @ dequant(b)^T`` in fp32 (plus ``bias``), rounded once to ``out_dtype``."""
    out = a.dequantize() @ b.dequantize().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _scaled_mm(a: Fp8Operand, b: Fp8Operand, *, out_dtype: torch.dtype, fast_accum: bool) -> Tensor:
    pair = (a.granularity, b.granularity)
    if pair not in SCALED_MM_PAIRS:
        raise ValueError(f"scaled_mm has no kernel for scales {pair}; use one of {SCALED_MM_PAIRS}")
    scale_a, scale_b = a.gemm_scale(), b.gemm_scale()
    if a.granularity == "row":  # A's [M, 1]; B's as [1, N]
        scale_b = scale_b.reshape(1, -1)
    if a.granularity == "tensor":
        scale_a, scale_b = scale_a.reshape(1), scale_b.reshape(1)
    if not hasattr(F, "scaled_mm"):  # torch < 2.10: the private op infers scalings from shapes
        return torch._scaled_mm(
            a.data, b.data.t(), scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum
        )
    return F.scaled_mm(
        a.data,
        b.data.t(),
        scale_a,
        getattr(F.ScalingType, _SCALING[a.granularity]),
        scale_b,
        getattr(F.ScalingType, _SCALING[b.granularity]),
        swizzle_a=F.SwizzleType.NO_SWIZZLE,
        swizzle_b=F.SwizzleType.NO_SWIZZLE,
        output_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def fp8_mm(
    a: Fp8Operand,
    b: Fp8Operand,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Tensor | None = None,
    backend: str | None = None,
    fast_accum: bool = False,
) -> Tensor:
    """``a @ b^T`` (``a`` ``[M, K]``, ``b`` ``[N, K]``, both quantised along K) in
    ``out_dtype``, accumulated in fp32; ``bias`` ``[N]`` added before the rounding on the
    emulated path and after it on ``scaled_mm``."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_mm: K differs, {tuple(a.shape)} @ {tuple(b.shape)}^T")
    if resolve_gemm_backend(backend, a.data, b.data) == "emulated":
        return emulated_mm(a, b, out_dtype=out_dtype, bias=bias)
    out = _scaled_mm(a, b, out_dtype=out_dtype, fast_accum=fast_accum)
    return out if bias is None else out + bias


_OUTPUT_OK: dict[tuple[str, str, torch.dtype, torch.device], bool] = {}


def output_supported(
    a_gran: str, b_gran: str, out_dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether ``fp8_mm`` can write ``out_dtype`` for this scale pair on ``device`` (tried once
    on a small GEMM and remembered; always true on the emulated path). The FP8 linear asks
    before writing a weight gradient in fp32 for megatron's fp32 ``main_grad``, and writes
    bf16 where the answer is no."""
    if device.type != "cuda":
        return True
    key = (a_gran, b_gran, out_dtype, device)
    if key not in _OUTPUT_OK:
        from longboat.kernels.fp8.quantize import quantize

        a = torch.ones(128, 256, device=device, dtype=torch.bfloat16)
        try:
            out = fp8_mm(quantize(a, a_gran), quantize(a, b_gran), out_dtype=out_dtype)
            _OUTPUT_OK[key] = bool(torch.allclose(out.float(), torch.full_like(out.float(), 256.0)))
        except (RuntimeError, ValueError, NotImplementedError):
            _OUTPUT_OK[key] = False
    return _OUTPUT_OK[key]


__all__ = [
    "GEMM_BACKENDS",
    "SCALED_MM_PAIRS",
    "emulated_mm",
    "fp8_mm",
    "output_supported",
    "resolve_gemm_backend",
]
