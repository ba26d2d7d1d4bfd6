"""longboat-kernels plugged into core.megatron's layer spec (``LayerKernels``).

core cannot import kernels (kernels sits above core), so the llm stack, which
depends on both, hands the kernels to the spec: attention through
``longboat.kernels.attention`` dispatch (SDPA flash / cuDNN without Transformer
Engine), RMSNorm, SwiGLU and RoPE (Triton on CUDA, torch reference elsewhere).
"""

from __future__ import annotations

from typing import Any

import torch

from longboat.core.megatron.specs import LayerKernels


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: Any = None,
) -> torch.Tensor:
    from longboat.kernels.attention import attention

    return attention(q, k, v, causal=causal, scale=scale, mask=mask)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from longboat.kernels.rmsnorm import rms_norm

    return rms_norm(x, weight, eps)  # type: ignore[return-value]


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    from longboat.kernels.swiglu import swiglu

    return swiglu(x)


def _rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from longboat.kernels.rope import apply_rope

    return apply_rope(q, k, cos, sin)


def longboat_layer_kernels(*, swiglu: bool = True, rope: bool = True) -> LayerKernels:
    """The longboat kernels as a ``LayerKernels`` bundle (``rope=False``: megatron's RoPE)."""
    return LayerKernels(
        attention=_attention,
        rms_norm=_rms_norm,
        swiglu=_swiglu if swiglu else None,
        rope=_rope if rope else None,
        name="longboat.kernels",
    )
