"""Latents back to pixels with a pipeline's VAE (previews), as diffusers' pipelines decode.

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

    def denormalise(self, latents: torch.Tensor) -> torch.Tensor:
        """``[C, T, H, W]`` dataset latents -> the VAE's own latents (float32)."""
        z = latents.detach().float().cpu()
        if self.kind == "AutoencoderKLWan":
            return z * self.std + self.mean
        return z / self.scale + self.shift

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """``[C, T, H, W]`` normalised latents -> uint8 ``[T', H', W', 3]`` pixels."""
        if latents.dim() != 4 or latents.shape[0] != self.channels:
            raise ValueError(
                f"latents of shape {tuple(latents.shape)}: expected [{self.channels}, T, H, W]"
            )
        z = self.denormalise(latents).to(self.device, self.vae.dtype)
        if self.kind == "AutoencoderKLWan":
            x = self.vae.decode(z[None]).sample[0]  # [3, T', H', W']
        else:
            x = self.vae.decode(z.permute(1, 0, 2, 3)).sample.permute(1, 0, 2, 3)
        x = ((x.float().cpu() + 1.0) / 2.0).clamp(0.0, 1.0)
        return np.round(x.permute(1, 2, 3, 0).numpy() * 255.0).astype(np.uint8)
