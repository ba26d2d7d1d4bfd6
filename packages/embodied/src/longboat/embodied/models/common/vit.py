"""SigLIP / SigLIP2-style vision transformer (pre-LN, gelu-tanh MLP, post-LN)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longboat.embodied.models.common import ops


@dataclass(kw_only=True)
class ViTConfig:
    """Shape of the vision tower."""

    hidden_size: int
    """Token width."""
    num_layers: int
    """Encoder layers."""
    num_heads: int
    """Attention heads."""
    intermediate_size: int
    """MLP inner width."""
    patch_size: int = 14
    """Square patch side in pixels."""
    pos_grid: tuple[int, int] = (16, 16)
    """(rows, cols) of the learned position table; other grids interpolate it (SigLIP2)."""
    layer_norm_eps: float = 1e-6
    """LayerNorm epsilon."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision.hidden_size={self.hidden_size} is not divisible by vision.num_heads="
                f"{self.num_heads}"
            )


def siglip_so400m(pos_grid: tuple[int, int]) -> ViTConfig:
    """The SigLIP(2) So400m/14 tower both GR00T N1.6 and pi0.5 use; ``pos_grid`` is the
    learned position table (16x16 for both: GR00T's SigLIP2 interpolates it to the 18x18
    patches of its 252 px crops, pi0.5's 224 px frames use it as is)."""
    return ViTConfig(
        hidden_size=1152,
        num_layers=27,
        num_heads=16,
        intermediate_size=4304,
        patch_size=14,
        pos_grid=pos_grid,
    )


class ViTBlock(nn.Module):
    """Pre-LN encoder block with biased projections."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.layer_norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.layer_norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, d)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        h = ops.layer_norm(x, self.layer_norm1.weight, self.layer_norm1.bias, self.layer_norm1.eps)
        q, k, v = self.qkv(h).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        a = ops.attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.out_proj(a)
        h = ops.layer_norm(x, self.layer_norm2.weight, self.layer_norm2.bias, self.layer_norm2.eps)
        return x + self.fc2(ops.gelu_tanh(self.fc1(h)))


class VisionTransformer(nn.Module):
    """pixels [N, 3, H, W] (normalised floats, H and W multiples of the patch) ->
    tokens [N, (H/p)*(W/p), D] in row-major patch order."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.patch_embed = nn.Conv2d(3, d, cfg.patch_size, stride=cfg.patch_size)
        gh, gw = cfg.pos_grid
        self.pos_embed = nn.Parameter(torch.empty(gh * gw, d))
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) position table (submodules reset themselves)."""
        nn.init.normal_(self.pos_embed, std=0.02)

    def _positions(self, gh: int, gw: int) -> Tensor:
        table = self.pos_embed
        if (gh, gw) == tuple(self.cfg.pos_grid):
            return table
        base_h, base_w = self.cfg.pos_grid
        grid = table.view(1, base_h, base_w, -1).permute(0, 3, 1, 2).float()
        grid = F.interpolate(grid, size=(gh, gw), mode="bilinear", antialias=True)
        return grid.permute(0, 2, 3, 1).reshape(gh * gw, -1).to(table.dtype)

    def forward(self, pixels: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Returns tokens and the (rows, cols) patch grid."""
        p = self.cfg.patch_size
        if pixels.shape[-1] % p or pixels.shape[-2] % p:
            raise ValueError(
                f"image size {tuple(pixels.shape[-2:])} is not a multiple of the patch size {p}; "
                "preprocess images to multiples of the patch grid first"
            )
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        gh, gw = x.shape[-2:]
        # Token-major before the add: the sum would keep the conv output's channel-major
        # strides, and every residual add and norm of the stream would then run strided.
        x = x.flatten(2).transpose(1, 2).contiguous() + self._positions(gh, gw)
        for block in self.blocks:
            x = block(x)
        ln = self.post_layernorm
        return ops.layer_norm(x, ln.weight, ln.bias, ln.eps), (gh, gw)
