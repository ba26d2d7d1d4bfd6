"""Looking at latents: a fixed channels -> RGB map and animated GIF previews.

The map is the transpose of the colour basis the synthetic squares are written with
(:func:`colour_basis`), so a sample of the quickstart's model shows the squares' real colours;
for VAE latents it is a deterministic false-colour view (decode with the VAE for real pixels).
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

__all__ = ["colour_basis", "latents_to_gif", "latents_to_rgb"]

_BASIS_SEED = 20261203


@lru_cache(maxsize=8)
def _basis(channels: int) -> np.ndarray:
    if channels < 3:
        raise ValueError(f"latents of {channels} channels: an RGB view needs at least 3")
    raw = np.random.default_rng(_BASIS_SEED).standard_normal((channels, 3))
    cols: list[np.ndarray] = []
    for j in range(3):  # Gram-Schmidt: orthonormal columns, the same on every machine
        v = raw[:, j].copy()
        for c in cols:
            v -= (c @ v) * c
        cols.append(v / np.linalg.norm(v))
    basis = np.stack(cols, axis=1)
    basis.setflags(write=False)
    return basis


def colour_basis(channels: int) -> np.ndarray:
    """``[channels, 3]`` float64 with orthonormal columns: latent = basis @ colour * scale,
    where colour = 2 * rgb - 1 and scale = sqrt(channels / 3) (unit mean square per channel)."""
    return _basis(int(channels))


def latents_to_rgb(latents: torch.Tensor | np.ndarray) -> np.ndarray:
    """``[C, T, H, W]`` latents -> ``[T, H, W, 3]`` uint8 through the fixed colour basis."""
    x = np.asarray(torch.as_tensor(latents).detach().float().cpu(), dtype=np.float64)
    if x.ndim != 4:
        raise ValueError(f"latents of shape {x.shape}: expected [C, T, H, W]")
    c = x.shape[0]
    colour = np.einsum("ck,cthw->thwk", colour_basis(c), x) / math.sqrt(c / 3)
    rgb = np.clip((colour + 1.0) / 2.0, 0.0, 1.0)
    return np.round(rgb * 255.0).astype(np.uint8)


def latents_to_gif(
    latents: torch.Tensor | np.ndarray,
    path: str | Path,
    *,
    scale: int = 8,
    frame_ms: int = 250,
) -> Path:
    """Write ``[C, T, H, W]`` (or ``[B, C, T, H, W]``, side by side) latents as an animated
    GIF, each latent cell ``scale x scale`` pixels, ``frame_ms`` per latent frame; returns the
    path."""
    from PIL import Image

    x = torch.as_tensor(latents)
    clips = [x] if x.dim() == 4 else list(x)
    rgbs = [latents_to_rgb(c) for c in clips]
    t = max(r.shape[0] for r in rgbs)
    h = max(r.shape[1] for r in rgbs)
    gap = 1
    w = sum(r.shape[2] for r in rgbs) + gap * (len(rgbs) - 1)
    canvas = np.full((t, h, w, 3), 255, dtype=np.uint8)
    at = 0
    for r in rgbs:
        # Shorter clips hold their last frame.
        frames = np.concatenate([r, np.repeat(r[-1:], t - r.shape[0], axis=0)], axis=0)
        canvas[:, : r.shape[1], at : at + r.shape[2]] = frames
        at += r.shape[2] + gap
    canvas = canvas.repeat(scale, axis=1).repeat(scale, axis=2)
    images = [Image.fromarray(f) for f in canvas]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(
        out, save_all=True, append_images=images[1:], duration=frame_ms, loop=0, optimize=False
    )
    return out
