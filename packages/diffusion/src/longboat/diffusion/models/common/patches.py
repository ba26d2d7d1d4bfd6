"""Latents <-> patch tokens and the per-axis rotary angles of a token grid (no megatron).

A latent ``[C, T, H, W]`` becomes ``t * h * w`` tokens (``(t, h, w) = (T, H, W) / patch``, the
sample's *grid*), frame-major then row-major, each token the ``C * pt * ph * pw`` values of
one patch flattened channel-first (``(c, dt, dy, dx)``: the order of a ``Conv3d`` kernel, so
the patch embedding is a Linear over the token). Output tokens use the same layout with the
output channels, so ``unpatchify(patchify(x))`` is ``x`` and a loss may compare tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Grid = tuple[int, int, int]
"""A sample's token grid ``(frames, rows, columns)`` in patches."""


def latent_grid(shape: Sequence[int], patch: Sequence[int]) -> Grid:
    """The token grid of a latent whose last three sizes are ``(T, H, W)``; ``ValueError`` when
    the patch does not divide them."""
    t, h, w = (int(s) for s in shape[-3:])
    pt, ph, pw = (int(p) for p in patch)
    if t % pt or h % ph or w % pw:
        raise ValueError(
            f"latent (T, H, W) = {(t, h, w)} is not divisible by the patch {(pt, ph, pw)}; "
            "crop or pad the latents (or the videos) to a multiple of it"
        )
    return t // pt, h // ph, w // pw


def patchify(latents: torch.Tensor, patch: Sequence[int]) -> torch.Tensor:
    """``[B, C, T, H, W]`` -> tokens ``[B, t*h*w, C*pt*ph*pw]`` (see the module doc)."""
    if latents.dim() != 5:
        raise ValueError(f"latents must be [B, C, T, H, W], got {tuple(latents.shape)}")
    b, c = latents.shape[:2]
    t, h, w = latent_grid(latents.shape, patch)
    pt, ph, pw = patch
    x = latents.reshape(b, c, t, pt, h, ph, w, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(b, t * h * w, c * pt * ph * pw)


def unpatchify(tokens: torch.Tensor, grid: Grid, patch: Sequence[int]) -> torch.Tensor:
    """Tokens ``[B, t*h*w, C*pt*ph*pw]`` of one ``grid`` -> ``[B, C, T, H, W]``."""
    b, s, dim = tokens.shape
    t, h, w = grid
    pt, ph, pw = patch
    if s != t * h * w or dim % (pt * ph * pw):
        raise ValueError(f"tokens {tuple(tokens.shape)} do not fit grid {grid} and patch {patch}")
    c = dim // (pt * ph * pw)
    x = tokens.reshape(b, t, h, w, c, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, c, t * pt, h * ph, w * pw)


def grid_angles(grid: Sequence[int], dims: Sequence[int], theta: float) -> torch.Tensor:
    """fp64 ``[t*h*w, sum(dims) // 2]`` rotary angles of the tokens of one grid.

    Rotary pair ``i`` of a head turns by the token's frame, row or column index (the first
    ``dims[0] / 2`` pairs by the frame, then rows, then columns) at frequencies
    ``theta ** (-2j / dims[axis])`` per axis; positions start at 0.
    """
    t, h, w = (int(g) for g in grid)
    axes = []
    for size, dim in zip((t, h, w), dims):
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        axes.append(torch.outer(torch.arange(size, dtype=torch.float64), inv_freq))
    ft = axes[0][:, None, None, :].expand(t, h, w, -1)
    fh = axes[1][None, :, None, :].expand(t, h, w, -1)
    fw = axes[2][None, None, :, :].expand(t, h, w, -1)
    return torch.cat([ft, fh, fw], dim=-1).reshape(t * h * w, -1)


__all__ = ["Grid", "grid_angles", "latent_grid", "patchify", "unpatchify"]
