"""The encoders of ``data prepare``: a Wan VAE (diffusers) and a UMT5 text encoder (transformers).

- Video / image frames (uint8 ``[T, H, W, 3]``) are scaled to ``[-1, 1]`` and encoded by
  ``AutoencoderKLWan``; the latents are the posterior mean, normalised per channel with the
  VAE config's ``latents_mean`` / ``latents_std`` (``(z - mean) / std``, what Wan's DiT is
  trained on and what diffusers' Wan pipelines undo before decoding).
- A caption is tokenised (special tokens added, at most ``max_text_len`` tokens) and encoded
  by ``UMT5EncoderModel`` alone, without padding: the ``[L, D]`` last hidden states of its
  ``L`` real tokens, as Wan keeps them before zero-padding to 512.

The three directories are given on their own or found in a diffusers Wan pipeline directory
(``model_dir``: ``vae/``, ``text_encoder/``, ``tokenizer/``). diffusers and transformers are
imported only when the encoders are loaded (the ``prepare`` extra).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longboat.core.config.errors import ProblemCollector
from longboat.diffusion.data.errors import DataError
from longboat.diffusion.data.schema import PrepareConfig

__all__ = ["EncoderDirs", "WanEncoders", "encoder_dirs", "encoders_key", "fingerprint_dir"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CONFIG_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "spiece.model",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass(frozen=True)
class EncoderDirs:
    """Where the VAE, the text encoder and its tokenizer are."""

    vae: Path
    text_encoder: Path
    tokenizer: Path


def encoder_dirs(cfg: PrepareConfig) -> EncoderDirs:
    """Resolve ``vae`` / ``text_encoder`` / ``tokenizer`` (``model_dir`` subfolders by default);
    ``ConfigError`` naming the key when a directory is missing or holds no model."""
    md = Path(cfg.model_dir).expanduser() if cfg.model_dir else None
    p = ProblemCollector()
    if md is not None and not md.is_dir():
        p.add("model_dir", "no such directory", value=cfg.model_dir)
        p.raise_if_any()

    def pick(key: str, sub: str, fallback: Path | None = None) -> Path:
        given = getattr(cfg, key)
        if given:
            return Path(given).expanduser()
        if md is not None and (md / sub).is_dir():
            return md / sub
        return fallback if fallback is not None else (md / sub if md else Path(""))

    vae = pick("vae", "vae")
    text_encoder = pick("text_encoder", "text_encoder")
    tokenizer = pick("tokenizer", "tokenizer", fallback=text_encoder)
    for key, path, needs in (
        ("vae", vae, ("config.json",)),
        ("text_encoder", text_encoder, ("config.json",)),
        ("tokenizer", tokenizer, ("tokenizer.json", "tokenizer_config.json", "spiece.model")),
    ):
        if not path.is_dir():
            p.add(key, "no such directory", value=str(path), fix=f"{key}=<dir> or model_dir=<dir>")
        elif not any((path / n).is_file() for n in needs):
            p.add(
                key,
                f"holds none of {', '.join(needs)}: not a saved {key.replace('_', ' ')}",
                value=str(path),
                fix=f"point {key} at the diffusers / transformers directory",
            )
    p.raise_if_any()
    return EncoderDirs(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)


def fingerprint_dir(path: Path) -> dict[str, Any]:
    """What identifies a saved model cheaply: SHA-256 of its config / tokenizer files and the
    names and sizes of its weight files (hashing gigabytes of weights is not cheap)."""
    configs = {
        n: hashlib.sha256((path / n).read_bytes()).hexdigest()
        for n in _CONFIG_FILES
        if (path / n).is_file()
    }
    weights = {
        f.name: f.stat().st_size
        for f in sorted(path.iterdir())
        if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES)
    }
    return {"configs": configs, "weights": weights}


class WanEncoders:
    """The loaded VAE and text encoder (see the module doc).

    Args:
        dirs: the three directories.
        device: where both run.
        vae_dtype / text_dtype: compute dtypes (``float32`` or ``bfloat16``).
        max_text_len: caption tokens kept.
    """

    def __init__(
        self,
        dirs: EncoderDirs,
        *,
        device: torch.device | str = "cpu",
        vae_dtype: str = "float32",
        text_dtype: str = "float32",
        max_text_len: int = 512,
    ) -> None:
        try:
            from diffusers import AutoencoderKLWan
            from transformers import AutoTokenizer, UMT5EncoderModel
        except ImportError as exc:
            raise DataError(
                f"data prepare needs diffusers and transformers ({exc}); install "
                "`longboat-diffusion[prepare]`"
            ) from None
        self.dirs = dirs
        self.device = torch.device(device)
        self.max_text_len = max_text_len
        try:
            self.vae = AutoencoderKLWan.from_pretrained(dirs.vae, torch_dtype=_DTYPES[vae_dtype])
        except Exception as exc:
            raise DataError(f"vae={dirs.vae}: not a loadable AutoencoderKLWan ({exc})") from None
        try:
            self.text_encoder = UMT5EncoderModel.from_pretrained(
                dirs.text_encoder, torch_dtype=_DTYPES[text_dtype]
            )
        except Exception as exc:
            raise DataError(
                f"text_encoder={dirs.text_encoder}: not a loadable UMT5EncoderModel ({exc})"
            ) from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(dirs.tokenizer)
        except Exception as exc:
            raise DataError(
                f"tokenizer={dirs.tokenizer}: not a loadable tokenizer ({exc})"
            ) from None
        self.vae.to(self.device).eval()
        self.text_encoder.to(self.device).eval()
        cfg = self.vae.config
        self.latent_channels = int(cfg.z_dim)
        self.temporal = int(cfg.scale_factor_temporal or 4)
        self.spatial = int(cfg.scale_factor_spatial or 8)
        self.text_dim = int(self.text_encoder.config.d_model)
        self._mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).reshape(-1, 1, 1, 1)
        self._std = torch.tensor(cfg.latents_std, dtype=torch.float32).reshape(-1, 1, 1, 1)
        if (
            self._mean.shape[0] != self.latent_channels
            or self._std.shape[0] != self.latent_channels
        ):
            raise DataError(
                f"vae={dirs.vae}: latents_mean / latents_std have {self._mean.shape[0]} / "
                f"{self._std.shape[0]} entries for z_dim={self.latent_channels}"
            )

    def check(self, cfg: PrepareConfig) -> None:
        """``ConfigError`` when the sizes or the frame count do not suit this VAE."""
        p = ProblemCollector()
        unit = 2 * self.spatial  # the VAE's downsampling times the DiT's 2x2 patch
        key = "sizes" if cfg.sizes else "height/width"
        bad = [list(t) for t in cfg.targets if t[0] % unit or t[1] % unit]
        if bad:
            p.add(key, f"must be multiples of {unit} for this VAE", value=bad)
        if (cfg.num_frames - 1) % self.temporal:
            p.add(
                "num_frames",
                f"must be {self.temporal}k + 1 for this VAE",
                value=cfg.num_frames,
            )
        p.raise_if_any()

    def fingerprint(self) -> dict[str, Any]:
        """The encoders' identities (stored in the manifest; a resumed run must match)."""
        return {
            "vae": {"class": type(self.vae).__name__, **fingerprint_dir(self.dirs.vae)},
            "text_encoder": {
                "class": type(self.text_encoder).__name__,
                **fingerprint_dir(self.dirs.text_encoder),
            },
            "tokenizer": {
                "class": type(self.tokenizer).__name__,
                **fingerprint_dir(self.dirs.tokenizer),
            },
        }

    @torch.no_grad()
    def encode_frames(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 ``[T, H, W, 3]`` -> normalised latents ``[C, T', H', W']`` (float32, CPU)."""
        x = torch.from_numpy(np.array(frames, dtype=np.uint8)).permute(3, 0, 1, 2)[None]
        x = (x.float() / 127.5 - 1.0).to(self.device, self.vae.dtype)
        z = self.vae.encode(x).latent_dist.mean[0].float().cpu()
        return (z - self._mean) / self._std

    @torch.no_grad()
    def encode_text(self, caption: str) -> torch.Tensor:
        """A caption -> ``[L, D]`` float32 (CPU) states of its ``L`` tokens."""
        enc = self.tokenizer(
            caption,
            truncation=True,
            max_length=self.max_text_len,
            add_special_tokens=True,
            return_tensors="pt",
        )
        ids = enc["input_ids"].to(self.device)
        mask = enc["attention_mask"].to(self.device)
        return (
            self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state[0].float().cpu()
        )


def encoders_key(fingerprint: dict[str, Any]) -> str:
    """One hash of a fingerprint (what a resumed run compares)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
