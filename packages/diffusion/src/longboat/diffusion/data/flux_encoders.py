"""The encoders of ``data prepare`` for FLUX.1: its ``AutoencoderKL``, T5 and CLIP (a FLUX
pipeline directory: ``vae/``, ``text_encoder/`` + ``tokenizer/`` (CLIP),
``text_encoder_2/`` + ``tokenizer_2/`` (T5)).

- Images (one frame; a video gives its first) are scaled to ``[-1, 1]`` and encoded; the
  latents are the posterior mean, normalised as FLUX's DiT is trained on them and the FLUX
  pipelines undo before decoding: ``(z - shift_factor) * scaling_factor``, stored
  ``[16, 1, H / 8, W / 8]``.
- A caption's ``text_embeds`` are the T5 encoder's states of its real tokens (at most
  ``max_text_len``, no padding), and its ``pooled_embeds`` CLIP's pooled output of the
  caption padded to 77 tokens, as ``FluxPipeline.encode_prompt`` computes both.

``data tiny-pipeline flux <dir>`` writes a tiny random FLUX pipeline these encoders load on
a CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from longboat.core.config.errors import ProblemCollector
from longboat.diffusion.data.encoders import _DTYPES, fingerprint_dir
from longboat.diffusion.data.errors import DataError
from longboat.diffusion.data.schema import PrepareConfig

__all__ = ["FLUX_PARTS", "FluxEncoders", "is_flux_pipeline"]

FLUX_PARTS = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
"""The pipeline folders the FLUX encoders read."""


def is_flux_pipeline(model_dir: str | Path | None) -> bool:
    """Whether ``model_dir`` is a FLUX pipeline directory (its ``model_index.json``)."""
    import json

    if not model_dir:
        return False
    index = Path(model_dir).expanduser() / "model_index.json"
    return index.is_file() and "Flux" in str(json.loads(index.read_text()).get("_class_name"))


class FluxEncoders:
    """The loaded FLUX VAE, T5 and CLIP (module doc); ``prepare``'s ``Encoders``."""

    temporal = 1

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: torch.device | str = "cpu",
        vae_dtype: str = "float32",
        text_dtype: str = "float32",
        max_text_len: int = 512,
    ) -> None:
        try:
            from diffusers import AutoencoderKL
            from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel
        except ImportError as exc:
            raise DataError(
                f"data prepare needs diffusers and transformers ({exc}); install "
                "`longboat-diffusion[prepare]`"
            ) from None
        root = Path(model_dir).expanduser()
        missing = [p for p in FLUX_PARTS if not (root / p).is_dir()]
        if missing:
            raise DataError(f"model_dir={root}: a FLUX pipeline without {', '.join(missing)}")
        self.dirs = {p: root / p for p in FLUX_PARTS}
        self.device = torch.device(device)
        self.max_text_len = max_text_len
        self.vae = AutoencoderKL.from_pretrained(root / "vae", torch_dtype=_DTYPES[vae_dtype])
        text = _DTYPES[text_dtype]
        self.clip = CLIPTextModel.from_pretrained(root / "text_encoder", torch_dtype=text)
        self.t5 = T5EncoderModel.from_pretrained(root / "text_encoder_2", torch_dtype=text)
        self.clip_tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
        self.t5_tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer_2")
        for m in (self.vae, self.clip, self.t5):
            m.to(self.device).eval()
        cfg = self.vae.config
        self.latent_channels = int(cfg.latent_channels)
        self.spatial = 2 ** (len(cfg.block_out_channels) - 1)
        self.scale, self.shift = float(cfg.scaling_factor), float(cfg.shift_factor or 0.0)
        self.text_dim = int(self.t5.config.d_model)
        self.pooled_dim = int(self.clip.config.hidden_size)

    def check(self, cfg: PrepareConfig) -> None:
        """``ConfigError`` when the sizes or the frame count do not suit FLUX."""
        p = ProblemCollector()
        unit = 2 * self.spatial  # the VAE's downsampling times the DiT's 2x2 patch
        key = "sizes" if cfg.sizes else "height/width"
        bad = [list(t) for t in cfg.targets if t[0] % unit or t[1] % unit]
        if bad:
            p.add(key, f"must be multiples of {unit} for this VAE", value=bad)
        if cfg.num_frames != 1:
            p.add("num_frames", "FLUX encodes images: one frame", value=cfg.num_frames,
                  fix="num_frames=1 (a video gives its first frame)")  # fmt: skip
        p.raise_if_any()

    def fingerprint(self) -> dict[str, Any]:
        """The encoders' identities (stored in the manifest; a resumed run must match)."""
        return {p: fingerprint_dir(d) for p, d in self.dirs.items()}

    @torch.no_grad()
    def encode_frames(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 ``[T, H, W, 3]`` -> normalised latents ``[C, T, H', W']`` (float32, CPU)."""
        x = torch.from_numpy(np.array(frames, dtype=np.uint8)).permute(0, 3, 1, 2)
        x = (x.float() / 127.5 - 1.0).to(self.device, self.vae.dtype)
        z = self.vae.encode(x).latent_dist.mean.float().cpu()  # [T, C, H', W']
        return ((z - self.shift) * self.scale).permute(1, 0, 2, 3).contiguous()

    @torch.no_grad()
    def encode_text(self, caption: str) -> torch.Tensor:
        """A caption -> ``[L, D]`` float32 (CPU) T5 states of its ``L`` tokens."""
        enc = self.t5_tokenizer(
            caption, truncation=True, max_length=self.max_text_len, return_tensors="pt"
        )
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        return self.t5(input_ids=ids, attention_mask=mask).last_hidden_state[0].float().cpu()

    @torch.no_grad()
    def encode_pooled(self, caption: str) -> torch.Tensor:
        """A caption -> ``[P]`` float32 (CPU): CLIP's pooled output at 77 tokens."""
        ids = self.clip_tokenizer(
            caption,
            padding="max_length",
            max_length=self.clip_tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        )["input_ids"].to(self.device)
        return self.clip(ids, output_hidden_states=False).pooler_output[0].float().cpu()
