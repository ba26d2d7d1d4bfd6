"""Single call sites for the hot ops of the embodied models.

Every attention / norm / activation in ``longboat.embodied.models`` goes through
the functions here, so switching an op to a ``longboat.kernels`` implementation
is a one-line change in this file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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
    (mask builders here guarantee it) so no row turns into NaN.
    """
    dtype = torch.promote_types(q.dtype, k.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, *, offset: float = 0.0) -> Tensor:
    """RMSNorm computed in fp32; ``offset=1`` gives Gemma's ``x * (1 + w)``."""
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.float() + offset)
    return y.to(dtype)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dim (weight/bias None = no affine)."""
    if weight is not None:
        x = x.to(weight.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def ada_layer_norm(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    """``LN(x) * (1 + scale) + shift`` (LN without affine); scale/shift: [B, D]."""
    y = F.layer_norm(x, (x.shape[-1],), None, None, eps)
    return y * (1 + scale[:, None]) + shift[:, None]


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU with the tanh approximation (SigLIP, Gemma, GR00T's DiT)."""
    return F.gelu(x, approximate="tanh")


def silu(x: Tensor) -> Tensor:
    """SiLU / swish."""
    return F.silu(x)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding (rotate-half convention). x: [B, H, L, D]; cos/sin: [B, L, D]."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    rotated = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotated * sin
