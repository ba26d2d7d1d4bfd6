"""longboat's kernels as the ``LayerKernels`` bundle core's decoder layer specs run on.

core cannot import kernels (kernels sits above core), so a stack that builds a megatron
decoder (llm, vlm) hands this bundle to the spec: attention through
``longboat.kernels.attention`` dispatch (SDPA flash / cuDNN without Transformer Engine),
RMSNorm, the fused attention-residual add + pre-MLP RMSNorm, SwiGLU, RoPE and the fused
QKV split + RoPE (Triton on CUDA, torch reference elsewhere), and optionally FP8 GEMMs for
the linears. No megatron import.
"""

from __future__ import annotations

from typing import Any

import torch

from longboat.core.layer_kernels import LayerKernels


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: Any = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    from longboat.kernels.attention import attention

    return attention(q, k, v, causal=causal, scale=scale, mask=mask, cu_seqlens=cu_seqlens)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from longboat.kernels.rmsnorm import rms_norm

    return rms_norm(x, weight, eps)  # type: ignore[return-value]


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from longboat.kernels.rmsnorm import add_rmsnorm

    return add_rmsnorm(x, residual, weight, eps)


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    from longboat.kernels.swiglu import swiglu

    return swiglu(x)


def _rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from longboat.kernels.rope import apply_rope

    return apply_rope(q, k, cos, sin)


_POSITIONS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _qkv_rope(
    mixed: torch.Tensor, groups: int, q_per_group: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from longboat.kernels.qkv_rope import positions_for_layout, split_qkv_rope

    s, b = mixed.shape[0], mixed.shape[1]
    key = (s, b, mixed.device)
    pos = _POSITIONS.get(key)
    if pos is None:  # megatron's [s, b] token order: position i repeated b times
        if len(_POSITIONS) > 8:
            _POSITIONS.clear()
        pos = _POSITIONS[key] = positions_for_layout(s, b, seq_first=True, device=mixed.device)
    return split_qkv_rope(mixed, groups, q_per_group, cos, sin, pos)


def longboat_layer_kernels(
    *,
    swiglu: bool = True,
    rope: bool = True,
    qkv_rope: bool = True,
    add_rms_norm: bool = True,
    fp8: str | None = None,
    linear: Any = None,
) -> LayerKernels:
    """The longboat kernels as a ``LayerKernels`` bundle.

    ``rope=False``: megatron's RoPE; ``qkv_rope=False``: megatron's QKV split views followed
    by the RoPE kernel (``qkv_rope`` needs ``rope``: it serves the same rotation).
    ``add_rms_norm=False``: megatron's attention residual add, then the RMSNorm kernel
    (instead of ``AddNormTransformerLayer`` with ``longboat.kernels.add_rmsnorm``).
    ``fp8``: an FP8 recipe (``blockwise``, ``rowwise``, ``tensorwise``, ``adaptive``) for the
    layers' linears and grouped MoE experts (``longboat.kernels.fp8``, per-expert scales for
    the experts; with ``blockwise`` and ``swiglu``, the MLP's SwiGLU writes its output straight
    as the down projection's FP8 operands: ``LayerKernels.glu_linear``); None keeps megatron's
    GEMMs and the bf16 grouped experts. ``linear``: a
    ``LinearFn`` of one's own for those linears instead (``fp8`` takes precedence).
    """
    grouped_linear = glu_linear = None
    if fp8 is not None:
        from longboat.kernels.fp8.layer_linear import (
            fp8_glu_linear_fn,
            fp8_grouped_linear_fn,
            fp8_linear_fn,
        )

        linear = fp8_linear_fn(fp8)
        grouped_linear = fp8_grouped_linear_fn(fp8, linear)
        glu_linear = fp8_glu_linear_fn(fp8) if swiglu else None
    return LayerKernels(
        attention=_attention,
        rms_norm=_rms_norm,
        add_rms_norm=_add_rms_norm if add_rms_norm else None,
        swiglu=_swiglu if swiglu else None,
        rope=_rope if rope else None,
        qkv_rope=_qkv_rope if rope and qkv_rope else None,
        linear=linear,
        grouped_linear=grouped_linear,
        glu_linear=glu_linear,
        name="longboat.kernels" if fp8 is None else f"longboat.kernels+fp8({fp8})",
    )
