"""Decoder-only language-model blocks in the Qwen3 and Gemma styles.

One ``DecoderLayer`` covers both (qk-norm, norm offset, MLP activation and bias are
config switches). The layer is split into ``project_qkv`` / ``finish`` so pi0.5 can run
two experts through one joint attention per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from longboat.embodied.models.common import ops
from longboat.embodied.models.common.layers import AdaRMSNorm, RMSNorm

# (cos table, sin table, positions [B, L]) as built by ``DecoderStack.rope``.
Rope = tuple[Tensor, Tensor, Tensor]


@dataclass(kw_only=True)
class DecoderConfig:
    """Shape of a decoder stack (an LM or pi0.5's action expert)."""

    hidden_size: int
    """Residual width."""
    num_layers: int
    """Number of decoder layers built."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int
    """Per-head width."""
    intermediate_size: int
    """Gated-MLP inner width."""
    vocab_size: int = 0
    """Token vocabulary (0: no embedding table, e.g. the action expert)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_eps: float = 1e-6
    """RMSNorm epsilon."""
    qk_norm: bool = False
    """Qwen3's per-head RMSNorm on queries and keys."""
    style: Literal["qwen3", "gemma"] = "qwen3"
    """qwen3: norms ``x*w``, SwiGLU; gemma: norms ``x*(1+w)``, GeGLU(tanh), embeddings
    scaled by sqrt(hidden)."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}; pick num_kv_heads dividing num_heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")


def _linear(layer: nn.Linear, x: Tensor) -> Tensor:
    # Parameters of one layer may differ in dtype (e.g. pi0.5 keeps unused ones frozen bf16).
    return layer(x.to(layer.weight.dtype))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` without biases."""

    def __init__(self, dim: int, inner: int, activation: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        h = ops.gated_activation(self.gate_proj(x), self.up_proj(x), self.activation)
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    """Pre-norm attention + gated MLP. With ``cond_dim`` the norms are adaRMSNorms and the
    residuals are gated (pi0.5's action expert)."""

    def __init__(self, cfg: DecoderConfig, cond_dim: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        d, h, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        offset = 1.0 if cfg.style == "gemma" else 0.0
        self.adaptive = cond_dim is not None
        if cond_dim is not None:
            self.input_norm: nn.Module = AdaRMSNorm(d, cond_dim, cfg.rms_eps)
            self.post_attention_norm: nn.Module = AdaRMSNorm(d, cond_dim, cfg.rms_eps)
        else:
            self.input_norm = RMSNorm(d, cfg.rms_eps, offset=offset)
            self.post_attention_norm = RMSNorm(d, cfg.rms_eps, offset=offset)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, hkv * hd, bias=False)
        self.v_proj = nn.Linear(d, hkv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm: nn.Module | None = RMSNorm(hd, cfg.rms_eps, offset=offset)
            self.k_norm: nn.Module | None = RMSNorm(hd, cfg.rms_eps, offset=offset)
        else:
            self.q_norm = self.k_norm = None
        act = "gelu_tanh" if cfg.style == "gemma" else "silu"
        self.mlp = GatedMLP(d, cfg.intermediate_size, act)

    @property
    def dtype(self) -> torch.dtype:
        """Residual-stream dtype (frozen layers may be bf16 while trainable ones are fp32)."""
        return self.k_proj.weight.dtype

    def _norm(
        self, norm: nn.Module, x: Tensor, cond: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        if self.adaptive:
            if cond is None:
                raise ValueError("this layer uses adaRMSNorm: pass cond (the time embedding)")
            return norm(x, cond)
        return norm(x), None

    def project_qkv(
        self, x: Tensor, rope: Rope, cond: Tensor | None = None, *, need_q: bool = True
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """x [B, L, D] -> q [B, H, L, hd], k, v [B, Hkv, L, hd] (rotated), attention gate.
        ``need_q=False`` skips the queries (an empty tensor is returned in their place)."""
        b, n, _ = x.shape
        hd = self.cfg.head_dim
        hx, gate = self._norm(self.input_norm, x.to(self.dtype), cond)
        k = _linear(self.k_proj, hx).view(b, n, -1, hd)
        v = _linear(self.v_proj, hx).view(b, n, -1, hd)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if not need_q:  # the fused RoPE rotates a (q, k) pair: pass k twice (it is small)
            _, k = ops.apply_rope(k, k, *rope)
            return k.new_empty(0), k.transpose(1, 2), v.transpose(1, 2), gate
        q = _linear(self.q_proj, hx).view(b, n, -1, hd)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q, k = ops.apply_rope(q, k, *rope)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate

    def finish(
        self, x: Tensor, attn: Tensor, gate: Tensor | None, cond: Tensor | None = None
    ) -> Tensor:
        """Output projection, (gated) residual, MLP. attn: [B, H, L, hd]."""
        b, _, n, _ = attn.shape
        x = x.to(self.dtype)
        out = _linear(self.o_proj, attn.transpose(1, 2).reshape(b, n, -1))
        x = x + out if gate is None else x + out * gate
        hx, gate2 = self._norm(self.post_attention_norm, x, cond)
        out = self.mlp(hx.to(self.mlp.down_proj.weight.dtype))
        return x + out if gate2 is None else x + out * gate2

    def forward(
        self, x: Tensor, rope: Rope, mask: Tensor | None, cond: Tensor | None = None
    ) -> Tensor:
        q, k, v, gate = self.project_qkv(x, rope, cond)
        return self.finish(x, ops.attention(q, k, v, mask), gate, cond)


class DecoderStack(nn.Module):
    """Token embedding (optional) + decoder layers; no final norm or LM head unless asked:
    the embodied models only read hidden states."""

    def __init__(
        self, cfg: DecoderConfig, *, cond_dim: int | None = None, final_norm: bool = False
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = (
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) if cfg.vocab_size > 0 else None
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, cond_dim) for _ in range(cfg.num_layers))
        offset = 1.0 if cfg.style == "gemma" else 0.0
        if final_norm:
            self.norm: nn.Module | None = (
                AdaRMSNorm(cfg.hidden_size, cond_dim, cfg.rms_eps)
                if cond_dim is not None
                else RMSNorm(cfg.hidden_size, cfg.rms_eps, offset=offset)
            )
        else:
            self.norm = None

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings (Gemma multiplies by sqrt(hidden))."""
        if self.embed_tokens is None:
            raise ValueError("this decoder has no embedding table (vocab_size=0)")
        x = self.embed_tokens(input_ids)
        if self.cfg.style == "gemma":
            x = x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)
        return x

    def rope(self, positions: Tensor, length: int | None = None) -> Rope:
        """Rotary tables covering positions < ``length`` (default: positions' seq len, which
        bounds padding-skipping positions) plus the positions themselves."""
        length = length if length is not None else positions.shape[-1]
        cos, sin = ops.rope_tables(length, self.cfg.head_dim, self.cfg.rope_theta, positions.device)
        return cos, sin, positions

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor | None) -> Tensor:
        """x: [B, L, D] embeddings; mask bool [B, 1, L, L] (True = attend)."""
        rope = self.rope(positions)
        for layer in self.layers:
            x = layer(x, rope, mask)
        return x
