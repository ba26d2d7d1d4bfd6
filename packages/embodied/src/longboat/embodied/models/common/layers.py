"""Small building blocks shared by the model families: norms, rotary tables, masks."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from longboat.embodied.models.common import ops


class RMSNorm(nn.Module):
    """RMSNorm; ``offset=1`` is Gemma's ``(1 + w)`` form (weight initialised to zero)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity scale: zeros in the (1 + w) form, ones otherwise."""
        nn.init.constant_(self.weight, 0.0 if self.offset else 1.0)

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps, offset=self.offset)


class AdaRMSNorm(nn.Module):
    """pi0.5's adaptive RMSNorm: a zero-initialised Dense(cond -> 3*dim) gives
    scale / shift / gate; the gate multiplies the residual branch the norm feeds."""

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.modulation = nn.Linear(cond_dim, 3 * dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero init as in openpi: scale = shift = gate = 0 at step 0."""
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x: Tensor, cond: Tensor) -> tuple[Tensor, Tensor]:
        """x: [B, L, D]; cond: [B, C]. Returns (normed x, gate [B, 1, D])."""
        mod = self.modulation(cond.to(self.modulation.weight.dtype))[:, None]
        scale, shift, gate = mod.chunk(3, dim=-1)
        y = ops.rms_norm(x, None, self.eps)
        return y * (1 + scale) + shift, gate


def positions_from_mask(mask: Tensor) -> Tensor:
    """Positions that skip padding: cumsum of the valid mask minus one, clamped at 0."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def sinusoidal_embedding(
    t: Tensor,
    dim: int,
    *,
    max_period: float = 10000.0,
    flip_sin_to_cos: bool = False,
    downscale_freq_shift: float = 0.0,
) -> Tensor:
    """diffusers-style sinusoidal embedding of t [...] -> [..., dim] (fp32)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32)
    exponent = exponent / (half - downscale_freq_shift)
    args = t.float()[..., None] * torch.exp(exponent)
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[..., half:], emb[..., :half]], dim=-1)
    return emb


def sincos_period_embedding(t: Tensor, dim: int, min_period: float, max_period: float) -> Tensor:
    """openpi's ``posemb_sincos``: periods spaced geometrically in [min, max] -> [B, dim]."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, device=t.device, dtype=torch.float32)
    period = min_period * (max_period / min_period) ** fraction
    args = t.float()[:, None] * (2 * math.pi / period)[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


def safe_key_mask(key_mask: Tensor) -> Tensor:
    """[B, S] bool -> [B, 1, 1, S]; a row with no valid key may attend to all keys, so
    attention never produces NaN (such rows carry no information anyway)."""
    key_mask = key_mask.bool()
    key_mask = key_mask | ~key_mask.any(-1, keepdim=True)
    return key_mask[:, None, None, :]


def ensure_row_nonempty(mask: Tensor) -> Tensor:
    """[B, L, L] bool: let rows without any allowed key (padding queries) see themselves."""
    eye = torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device)
    empty = ~mask.any(-1, keepdim=True)
    return mask | (eye & empty)
