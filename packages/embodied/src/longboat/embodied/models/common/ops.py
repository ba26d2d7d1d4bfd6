"""Single call sites for the hot ops of the embodied models.

Every attention / norm / gated activation / rotary embedding in
``longboat.embodied.models`` goes through the functions here. They forward to
``longboat.kernels`` (Triton on CUDA tensors, the torch references elsewhere; attention
dispatch picks the backend), so swapping an implementation is a one-line change here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from longboat import kernels


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Scaled dot-product attention with grouped KV heads.

    q: [B, H, L, D]; k, v: [B, Hkv, S, D] with H % Hkv == 0; mask: bool, broadcastable to
    [B, H, L, S], True = may attend. Every query row must be allowed at least one key
    (mask builders here guarantee it) so no row turns into NaN. Returns [B, H, L, D].
    """
    dtype = torch.promote_types(q.dtype, k.dtype)
    if mask is not None and q.shape[1] != k.shape[1]:
        # With a dense mask SDPA cannot use flash; its memory-efficient kernel takes masks
        # but not grouped KV heads, so expand K/V (cheap at these sequence lengths) instead
        # of falling back to the math kernel.
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # kernels take [B, S, H, D]
    return kernels.attention(q, k, v, causal=is_causal, mask=mask, scale=scale).transpose(1, 2)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, *, offset: float = 0.0) -> Tensor:
    """RMSNorm with fp32 statistics; ``offset=1`` gives Gemma's ``x * (1 + w)``;
    ``weight=None`` normalises only (adaRMSNorm)."""
    if weight is None:
        weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    elif offset:
        weight = weight.float() + offset  # in fp32: 1 + w rounds badly in bf16
    return kernels.rms_norm(x, weight, eps)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dim (weight/bias None = no affine); computes in the
    parameters' dtype when there are parameters."""
    if weight is not None:
        x = x.to(weight.dtype)
    return kernels.layer_norm(x, weight, bias, eps)


def ada_layer_norm(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    """``LN(x) * (1 + scale) + shift`` (LN without affine); x [B, L, D], scale/shift [B, D]."""
    dtype = torch.promote_types(x.dtype, scale.dtype)
    return kernels.ada_layer_norm(x.to(dtype), scale.to(dtype), shift.to(dtype), eps)


def gated_activation(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """``act(gate) * up``: SwiGLU (``silu``) or GeGLU (``gelu_tanh``)."""
    return kernels.glu(gate, up, activation)


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU with the tanh approximation (SigLIP, GR00T's DiT)."""
    return F.gelu(x, approximate="tanh")


def silu(x: Tensor) -> Tensor:
    """SiLU / swish."""
    return F.silu(x)


def rope_tables(
    length: int, head_dim: int, theta: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    """fp32 rotary tables [length, head_dim // 2] for positions < length."""
    return kernels.rope_cos_sin(length, head_dim, theta, device=device)


def apply_rope(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor]:
    """Rotate q [B, L, H, D] and k [B, L, Hkv, D] by integer positions [B, L]
    (half-split / NeoX layout)."""
    return kernels.apply_rope(q, k, cos, sin, positions)
