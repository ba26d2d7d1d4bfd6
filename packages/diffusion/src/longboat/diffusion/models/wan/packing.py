"""Packing of differently sized video samples and Wan's 3D rotary tables.

Latents become patch tokens as ``longboat.diffusion.models.common.patches`` lays them out
(``patchify`` / ``unpatchify`` / ``latent_grid``, re-exported here).

Packing concatenates several samples' tokens along the token dimension; ``VideoPacking``
records each sample's grid and the ``cu_seqlens`` offsets (flash-attn's varlen convention)
that keep attention inside each sample. No megatron import.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from longboat.core.device.transfer import to_device
from longboat.diffusion.models.common.patches import (
    Grid,
    grid_angles,
    latent_grid,
    patchify,
    unpatchify,
)
from longboat.diffusion.models.wan.config import WanConfig


def _to(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    return t if device is None else to_device(t, torch.device(device))


@dataclass(frozen=True)
class VideoPacking:
    """Where each sample's tokens sit in a packed ``[total, dim]`` sequence."""

    grids: tuple[Grid, ...]
    """Per sample ``(t, h, w)`` token grid, in packing order."""
    cu_seqlens: torch.Tensor
    """``[n + 1]`` int32 token offsets of the samples (first 0, last ``total``)."""
    max_seqlen: int
    """Tokens of the longest sample."""

    @classmethod
    def from_grids(
        cls, grids: Sequence[Sequence[int]], device: torch.device | str | None = None
    ) -> VideoPacking:
        """The packing of samples with token grids ``grids`` (in that order)."""
        norm = tuple((int(g[0]), int(g[1]), int(g[2])) for g in grids)
        if not norm or any(min(g) < 1 for g in norm):
            raise ValueError(f"grids must be one or more positive (t, h, w), got {list(grids)}")
        lengths = [math.prod(g) for g in norm]
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        return cls(grids=norm, cu_seqlens=_to(cu, device), max_seqlen=max(lengths))

    @property
    def seqlens(self) -> list[int]:
        """Tokens per sample."""
        return [math.prod(g) for g in self.grids]

    @property
    def num_samples(self) -> int:
        return len(self.grids)

    @property
    def total(self) -> int:
        """Tokens of all samples."""
        return sum(self.seqlens)

    def to(self, device: torch.device | str) -> VideoPacking:
        """A copy whose ``cu_seqlens`` live on ``device``."""
        return VideoPacking(self.grids, _to(self.cu_seqlens, device), self.max_seqlen)


def pack_latents(
    samples: Sequence[torch.Tensor], patch: Sequence[int]
) -> tuple[torch.Tensor, VideoPacking]:
    """Latents ``[C, T_i, H_i, W_i]`` -> packed tokens ``[sum(t_i*h_i*w_i), C*pt*ph*pw]`` and
    their ``VideoPacking``."""
    if not samples:
        raise ValueError("pack_latents needs at least one sample")
    tokens, grids = [], []
    for i, x in enumerate(samples):
        if x.dim() != 4 or x.shape[0] != samples[0].shape[0]:
            raise ValueError(
                f"sample {i}: latents must be [C, T, H, W] with the channels of sample 0, got "
                f"{tuple(x.shape)}"
            )
        grids.append(latent_grid(x.shape, patch))
        tokens.append(patchify(x.unsqueeze(0), patch)[0])
    return torch.cat(tokens), VideoPacking.from_grids(grids, device=samples[0].device)


def unpack_tokens(
    tokens: torch.Tensor, packing: VideoPacking, patch: Sequence[int]
) -> list[torch.Tensor]:
    """Packed tokens ``[total, C*pt*ph*pw]`` -> one ``[C, T_i, H_i, W_i]`` latent per sample."""
    if tokens.dim() != 2 or tokens.shape[0] != packing.total:
        raise ValueError(
            f"packed tokens must be [{packing.total}, dim] for this packing, got "
            f"{tuple(tokens.shape)}"
        )
    parts = tokens.split(packing.seqlens)
    return [unpatchify(p.unsqueeze(0), g, patch)[0] for p, g in zip(parts, packing.grids)]


# -- rotary ----------------------------------------------------------------------------------


def rope_tables(
    grids: Sequence[Grid], cfg: WanConfig, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos`` / ``sin`` ``[sum(t*h*w), head_dim // 2]`` of the samples' tokens in order.

    Rotary pair ``i`` of a head turns by the frame, row or column index of the token (the
    head's first ``dims[0] / 2`` pairs by the frame, then rows, then columns), frequencies
    ``theta ** (-2j / dims[axis])`` per axis; each sample's positions start at 0.
    """
    dims, theta = cfg.rope_dims, float(cfg.rope_theta)
    where = str(torch.device(device or "cpu"))
    tables = [_grid_tables(tuple(g), dims, theta, where) for g in grids]
    if len(tables) == 1:
        return tables[0]
    return torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])


@functools.lru_cache(maxsize=64)
def _grid_tables(
    grid: Grid, dims: tuple[int, int, int], theta: float, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    # Cached on the device: a training run sees the same few grids every step.
    angles = grid_angles(grid, dims, theta)
    return angles.cos().float().to(device), angles.sin().float().to(device)


__all__ = [
    "Grid",
    "VideoPacking",
    "latent_grid",
    "pack_latents",
    "patchify",
    "rope_tables",
    "unpack_tokens",
    "unpatchify",
]
