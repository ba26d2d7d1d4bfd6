"""The empty caption's text embedding of a latent dataset, for classifier-free guidance.

Training with ``data.caption_dropout`` replaces a share of the captions with the embedding
the dataset's text encoder gives the empty caption ``""`` (what a diffusers pipeline feeds as
the negative prompt when guidance is on), so the model also learns the unconditional
velocity. ``data prepare`` and the synthetic sets write it beside the manifest as
``empty_caption.safetensors`` (``text_embeds [L, D]``); a ``prepare`` run again over a
finished dataset adds it when it is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "EMPTY_CAPTION",
    "read_empty_caption",
    "read_empty_caption_parts",
    "write_empty_caption",
]

EMPTY_CAPTION = "empty_caption.safetensors"


def write_empty_caption(
    root: str | Path, text_embeds: torch.Tensor, pooled_embeds: torch.Tensor | None = None
) -> Path:
    """Write ``text_embeds`` ``[L, D]`` (L >= 1) and, for families with one, the pooled
    embedding ``[P]`` as ``root``'s empty caption (atomically)."""
    if text_embeds.dim() != 2 or text_embeds.shape[0] < 1:
        raise ValueError(
            f"empty caption embedding of shape {tuple(text_embeds.shape)}: want [L, D]"
        )
    out = Path(root) / EMPTY_CAPTION
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tensors = {"text_embeds": text_embeds.detach().float().cpu().contiguous()}
    if pooled_embeds is not None:
        tensors["pooled_embeds"] = pooled_embeds.detach().float().cpu().contiguous()
    save_file(tensors, str(tmp))
    os.replace(tmp, out)
    return out


def read_empty_caption(root: str | Path) -> torch.Tensor | None:
    """``root``'s empty caption embedding ``[L, D]`` float32 (None: the dataset has none)."""
    found = read_empty_caption_parts(root)
    return None if found is None else found["text_embeds"]


def read_empty_caption_parts(root: str | Path) -> dict[str, torch.Tensor] | None:
    """``root``'s empty caption: ``text_embeds`` and, where stored, ``pooled_embeds``."""
    path = Path(root) / EMPTY_CAPTION
    if not path.is_file():
        return None
    return load_file(str(path))
