"""DiT blocks with AdaLN timestep conditioning (GR00T's action head)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from longboat.embodied.models.common import ops
from longboat.embodied.models.common.layers import sinusoidal_embedding


@dataclass(kw_only=True)
class DiTConfig:
    """Shape of the alternating self/cross-attention DiT."""

    num_layers: int
    """Blocks; odd ones self-attend, even ones cross-attend (text / image alternately)."""
    num_heads: int
    """Attention heads."""
    head_dim: int
    """Per-head width; inner dim = num_heads * head_dim."""
    cross_attention_dim: int
    """Width of the backbone features the cross-attention blocks read."""
    output_dim: int
    """Width of the DiT output (fed to the action decoder)."""
    ff_mult: int = 4
    """Feed-forward inner width = ff_mult * inner dim."""
    dropout: float = 0.2
    """Dropout on attention and feed-forward outputs."""
    timestep_channels: int = 256
    """Sinusoidal channels of the timestep embedding."""
    norm_eps: float = 1e-5
    """Block LayerNorm epsilon."""
    attend_text_every_n_blocks: int = 2
    """Cross-attention blocks alternate: idx % (2n) == 0 reads text, otherwise images."""

    @property
    def inner_dim(self) -> int:
        """Residual width of the DiT."""
        return self.num_heads * self.head_dim


class TimestepEncoder(nn.Module):
    """Discrete timestep -> sinusoidal(256, flip, shift 1) -> Linear -> SiLU -> Linear."""

    def __init__(self, channels: int, dim: int) -> None:
        super().__init__()
        self.channels = channels
        self.linear_1 = nn.Linear(channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, timesteps: Tensor) -> Tensor:
        emb = sinusoidal_embedding(
            timesteps, self.channels, flip_sin_to_cos=True, downscale_freq_shift=1
        ).to(self.linear_1.weight.dtype)
        return self.linear_2(ops.silu(self.linear_1(emb)))


class Attention(nn.Module):
    """Multi-head attention with biased projections; keys from ``context`` if given."""

    def __init__(self, dim: int, heads: int, head_dim: int, kv_dim: int | None) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(kv_dim or dim, inner)
        self.to_v = nn.Linear(kv_dim or dim, inner)
        self.to_out = nn.Linear(inner, dim)

    def forward(self, x: Tensor, context: Tensor | None, mask: Tensor | None) -> Tensor:
        b, n, _ = x.shape
        ctx = x if context is None else context.to(x.dtype)
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k = self.to_k(ctx).view(b, ctx.shape[1], self.heads, -1).transpose(1, 2)
        v = self.to_v(ctx).view(b, ctx.shape[1], self.heads, -1).transpose(1, 2)
        out = ops.attention(q, k, v, mask).transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class DiTBlock(nn.Module):
    """AdaLN -> (self or cross) attention -> residual; LN -> gelu-tanh FF -> residual."""

    def __init__(self, cfg: DiTConfig, *, cross: bool) -> None:
        super().__init__()
        dim = cfg.inner_dim
        self.eps = cfg.norm_eps
        self.cross = cross
        self.norm1_linear = nn.Linear(dim, 2 * dim)  # AdaLayerNorm: silu(temb) -> scale, shift
        self.attn = Attention(
            dim, cfg.num_heads, cfg.head_dim, cfg.cross_attention_dim if cross else None
        )
        self.ff_in = nn.Linear(dim, cfg.ff_mult * dim)
        self.ff_out = nn.Linear(cfg.ff_mult * dim, dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: Tensor, temb: Tensor, context: Tensor | None, context_mask: Tensor | None
    ) -> Tensor:
        scale, shift = self.norm1_linear(ops.silu(temb)).chunk(2, dim=-1)
        h = ops.ada_layer_norm(x, scale, shift, self.eps)
        x = x + self.dropout(self.attn(h, context if self.cross else None, context_mask))
        h = ops.layer_norm(x, None, None, self.eps)
        h = self.dropout(ops.gelu_tanh(self.ff_in(h)))
        return x + self.dropout(self.ff_out(h))


class AlternatingDiT(nn.Module):
    """GR00T N1.6's DiT: odd blocks self-attend over [state, action tokens]; block idx with
    idx % (2n) == 0 cross-attends to text tokens, the other even blocks to image tokens."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.inner_dim
        self.timestep_encoder = TimestepEncoder(cfg.timestep_channels, dim)
        self.blocks = nn.ModuleList(
            DiTBlock(cfg, cross=(i % 2 == 0)) for i in range(cfg.num_layers)
        )
        self.proj_out_1 = nn.Linear(dim, 2 * dim)
        self.proj_out_2 = nn.Linear(dim, cfg.output_dim)

    def block_kind(self, idx: int) -> str:
        """'self', 'text' or 'image' for block idx."""
        if idx % 2 == 1:
            return "self"
        return "text" if idx % (2 * self.cfg.attend_text_every_n_blocks) == 0 else "image"

    def forward(
        self,
        x: Tensor,
        timesteps: Tensor,
        context: Tensor,
        text_mask: Tensor,
        image_mask: Tensor,
    ) -> Tensor:
        """x: [B, T, inner]; timesteps: [B] discrete; context: [B, S, cross_dim];
        text_mask / image_mask: [B, 1, 1, S] bool. Returns [B, T, output_dim]."""
        temb = self.timestep_encoder(timesteps)
        for i, block in enumerate(self.blocks):
            kind = self.block_kind(i)
            mask = None if kind == "self" else (text_mask if kind == "text" else image_mask)
            x = block(x, temb, context, mask)
        shift, scale = self.proj_out_1(ops.silu(temb)).chunk(2, dim=-1)
        x = ops.ada_layer_norm(x, scale, shift, 1e-6)
        return self.proj_out_2(x)
