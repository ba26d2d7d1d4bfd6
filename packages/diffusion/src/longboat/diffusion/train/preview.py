"""Previews: few-step samples for held-out captions, as an animated GIF or a PNG grid.

Captions are taken from the held-out set (distinct captions, the longest clips first, so
motion shows); each is sampled from seeded noise with the Euler sampler at its held-out
sample's latent shape, and the sheet shows every sample next to that held-out sample with
the caption written under them. With a VAE (``LatentDecoder``: the run's pipeline's, else the
preview set's own, as the quickstart's squares carry) both are decoded to pixels (one VAE call
per latent shape), videos as an animated GIF and images as a PNG grid; without one the
latents are shown through the fixed colour basis (``latents_to_rgb``). When the
held-out samples are the synthetic squares (their metadata names colour and direction),
``read_square`` reads each sample's colour and motion and the preview counts how many match
the caption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longboat.diffusion.data.batching import collate_latents
from longboat.diffusion.data.dataset import LatentDataset
from longboat.diffusion.data.preview import latents_to_rgb, write_sheet
from longboat.diffusion.objective.sampling import sample
from longboat.diffusion.train.data import model_kwargs, noise_seed

__all__ = ["PreviewResult", "pick_captions", "preview"]

_PREVIEW_STREAM = 0x9E71_E3
"""Tag of the preview's noise seeds."""


@dataclass
class PreviewResult:
    """What ``preview`` wrote and, for the synthetic squares, what it read back."""

    path: Path | None
    """The sheet written (GIF, mp4 or PNG; None on ranks that do not write)."""
    captions: list[str]
    colour_right: int | None = None
    """Samples whose square has the caption's colour (None: data without colour labels)."""
    direction_right: int | None = None
    """Samples whose square moves the caption's way (of ``moving``)."""
    moving: int = 0
    """Captions that name a direction."""
    readings: list[tuple[str, str]] = field(default_factory=list)
    """(colour, direction) read from each sample."""
    samples: list[torch.Tensor] = field(default_factory=list)
    """The generated latents, ``[C, T, H, W]`` per caption."""
    pixels: list[np.ndarray] | None = None
    """Each sample decoded by the VAE, uint8 ``[T', H', W', 3]`` (None: no VAE, or a rank
    that does not write)."""


def _decode(
    decoder: Any,
    generated: list[torch.Tensor],
    held_out: list[torch.Tensor],
    by_shape: dict[tuple[int, ...], list[int]],
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The samples and their held-out clips decoded, one VAE call per latent shape."""
    pixels: list[Any] = [None] * len(generated)
    clips: list[Any] = [None] * len(generated)
    for ks in by_shape.values():
        both = torch.stack([generated[k] for k in ks] + [held_out[k].float() for k in ks])
        decoded = decoder.decode(both)
        for j, k in enumerate(ks):
            pixels[k], clips[k] = decoded[j], decoded[len(ks) + j]
    return pixels, clips


def pick_captions(dataset: LatentDataset, n: int, limit: int = 0) -> list[int]:
    """Indices of up to ``n`` held-out samples of distinct captions, from the largest shape
    (most frames, then most positions) down; ties keep dataset order."""
    count = len(dataset) if limit <= 0 else min(limit, len(dataset))
    shapes = dataset.shapes[:count]
    order = sorted(range(count), key=lambda i: (-int(shapes[i].prod()), -int(shapes[i][0]), i))
    picked, seen = [], set()
    for i in order:
        if len(picked) == n:
            break
        caption = dataset[i]["caption"]
        if caption not in seen:
            seen.add(caption)
            picked.append(i)
    return picked


@torch.no_grad()
def preview(
    model: Any,
    dataset: LatentDataset,
    indices: list[int],
    out_path: Path,
    *,
    steps: int,
    shift: float,
    seed: int,
    num_train_timesteps: int,
    device: torch.device,
    write: bool,
    decoder: Any = None,
    video: str = "gif",
) -> PreviewResult:
    """Sample ``indices``' captions (every rank of a context-parallel group together), write
    the sheet when ``write`` (``out_path``'s suffix becomes ``.gif`` or ``.png``; pixels
    decoded by ``decoder``, a ``LatentDecoder``, when given), and read the squares back when
    the data are the synthetic set."""
    samples = [dataset[i] for i in indices]
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for k, s in enumerate(samples):
        by_shape.setdefault(tuple(s["latents"].shape), []).append(k)
    out: dict[int, torch.Tensor] = {}
    for shape, ks in by_shape.items():
        batch = collate_latents([samples[k] for k in ks])
        gen = torch.Generator().manual_seed(noise_seed(seed, _PREVIEW_STREAM, indices[ks[0]]))
        x = sample(
            model,
            (len(ks), *shape),
            batch["text_embeds"].to(device),
            batch["text_mask"].to(device),
            steps=steps,
            shift=shift,
            generator=gen,
            num_train_timesteps=num_train_timesteps,
            device=device,
            model_kwargs=model_kwargs(batch, device),
        )
        for j, k in enumerate(ks):
            out[k] = x[j].float().cpu()
    generated = [out[k] for k in range(len(samples))]
    captions = [s["caption"] for s in samples]
    path, pixels = None, None
    if write:
        if decoder is not None:
            pixels, clips = _decode(decoder, generated, [s["latents"] for s in samples], by_shape)
        else:
            clips = [latents_to_rgb(s["latents"].float()) for s in samples]
        views = pixels if pixels is not None else [latents_to_rgb(g) for g in generated]
        cells = [([v, c], t) for v, c, t in zip(views, clips, captions, strict=True)]
        frame_ms = 125 if decoder is not None else 250
        path = write_sheet(cells, out_path, frame_ms=frame_ms, min_height=96, video=video)
    result = PreviewResult(path=path, captions=captions, samples=generated, pixels=pixels)
    metas = [s["metadata"] for s in samples]
    if samples and all("colour" in m and "direction" in m for m in metas):
        from longboat.diffusion.data.synthetic import read_square

        readings = [read_square(g) for g in generated]
        result.readings = [(r.colour, r.direction) for r in readings]
        result.colour_right = sum(
            r.colour == m["colour"] for r, m in zip(readings, metas, strict=True)
        )
        moving = [(r, m) for r, m in zip(readings, metas, strict=True) if m["direction"]]
        result.moving = len(moving)
        result.direction_right = sum(r.direction == m["direction"] for r, m in moving)
    return result
