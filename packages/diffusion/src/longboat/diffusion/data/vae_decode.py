"""Latents back to pixels with a VAE (previews), as diffusers' pipelines decode.

The VAE is a pipeline's (``of_pipeline``) or a latent dataset's own (``of_dataset``: the
``vae/`` a set carries, as the quickstart's synthetic squares do, or the VAE directory
``data prepare`` recorded in its manifest).

A latent dataset holds normalised latents; ``LatentDecoder`` undoes the normalisation the
VAE's config names and decodes:

- ``AutoencoderKLWan`` (Wan): ``z * latents_std + latents_mean`` per channel, then the video
  decoder on ``[C, T, H, W]`` (``4 (T - 1) + 1`` frames out);
- ``AutoencoderKL`` (FLUX): ``z / scaling_factor + shift_factor``, then the image decoder on
  each latent frame.

Pixels come back as uint8 ``[T, H, W, 3]`` (``(x + 1) / 2`` clamped, as diffusers'
``VideoProcessor`` / ``VaeImageProcessor`` do).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["LatentDecoder"]


class LatentDecoder:
    """A VAE directory's decoder of normalised latents (module doc)."""

    def __init__(self, vae_dir: str | Path, *, device: torch.device | str = "cpu") -> None:
        import diffusers

        self.dir = Path(vae_dir)
        config = json.loads((self.dir / "config.json").read_text())
        self.kind = str(config.get("_class_name"))
        if self.kind not in ("AutoencoderKLWan", "AutoencoderKL"):
            raise ValueError(
                f"{self.dir}: a {self.kind} VAE; previews decode AutoencoderKLWan (Wan) and "
                "AutoencoderKL (FLUX)"
            )
        self.device = torch.device(device)
        self.vae = getattr(diffusers, self.kind).from_pretrained(self.dir).to(self.device).eval()
        cfg = self.vae.config
        if self.kind == "AutoencoderKLWan":
            self.channels = int(cfg.z_dim)
            self.mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(-1, 1, 1, 1)
            self.std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(-1, 1, 1, 1)
        else:
            self.channels = int(cfg.latent_channels)
            self.scale = float(cfg.scaling_factor)
            self.shift = float(cfg.shift_factor or 0.0)

    @classmethod
    def of_pipeline(cls, pipeline: str | Path | None, **kw: object) -> LatentDecoder | None:
        """The decoder of a pipeline directory's ``vae/`` (None without one)."""
        if pipeline is None or not (Path(pipeline) / "vae" / "config.json").is_file():
            return None
        return cls(Path(pipeline) / "vae", **kw)  # type: ignore[arg-type]

    @classmethod
    def of_dataset(cls, dataset: Any, **kw: object) -> LatentDecoder | None:
        """The decoder of the VAE a latent dataset names (None without one, or without
        diffusers): the first of its directories holding ``vae/config.json``, else the
        ``encoders.vae.dir`` its manifest records (``data prepare``), where it still exists."""
        import importlib.util

        if importlib.util.find_spec("diffusers") is None:
            return None
        for root, manifest in zip(dataset.roots, dataset.manifests, strict=True):
            recorded = (manifest.get("encoders") or {}).get("vae")
            for vae in (
                Path(root) / "vae",
                recorded.get("dir") if isinstance(recorded, dict) else None,
            ):
                if vae and (Path(root) / vae / "config.json").is_file():
                    return cls(Path(root) / vae, **kw)  # type: ignore[arg-type]
        return None

    def denormalise(self, latents: torch.Tensor) -> torch.Tensor:
        """``[C, T, H, W]`` dataset latents -> the VAE's own latents (float32)."""
        z = latents.detach().float().cpu()
        if self.kind == "AutoencoderKLWan":
            return z * self.std + self.mean
        return z / self.scale + self.shift

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """``[C, T, H, W]`` normalised latents -> uint8 ``[T', H', W', 3]`` pixels; a batch
        ``[B, C, T, H, W]`` of one shape -> ``[B, T', H', W', 3]`` (one VAE call)."""
        one = latents.dim() == 4
        z = latents[None] if one else latents
        if z.dim() != 5 or z.shape[1] != self.channels:
            raise ValueError(
                f"latents of shape {tuple(latents.shape)}: expected [{self.channels}, T, H, W]"
                " or a batch of them"
            )
        z = torch.stack([self.denormalise(x) for x in z]).to(self.device, self.vae.dtype)
        if self.kind == "AutoencoderKLWan":
            x = self.vae.decode(z).sample  # [B, 3, T', H', W']
        else:  # every latent frame an image
            b, c, t, h, w = z.shape
            frames = z.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
            x = self.vae.decode(frames).sample
            x = x.reshape(b, t, *x.shape[1:]).permute(0, 2, 1, 3, 4)
        x = ((x.float().cpu() + 1.0) / 2.0).clamp(0.0, 1.0)
        pixels = np.round(x.permute(0, 2, 3, 4, 1).numpy() * 255.0).astype(np.uint8)
        return pixels[0] if one else pixels
