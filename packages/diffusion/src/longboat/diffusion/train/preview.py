"""The end-of-run preview: few-step samples for held-out captions, as an animated GIF.

Captions are taken from the held-out set (distinct captions, the longest clips first, so
motion shows); each is sampled from seeded noise with the Euler sampler at its held-out
sample's latent shape, and the GIF shows every sample next to that held-out sample. When the
held-out samples are the synthetic squares (their metadata names colour and direction),
``read_square`` reads each sample's colour and motion and the preview counts how many match
the caption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from longboat.diffusion.data.batching import collate_latents
from longboat.diffusion.data.dataset import LatentDataset
from longboat.diffusion.data.preview import latents_to_gif
from longboat.diffusion.objective.sampling import sample
from longboat.diffusion.train.data import noise_seed

__all__ = ["PreviewResult", "pick_captions", "preview"]

_PREVIEW_STREAM = 0x9E71_E3
"""Tag of the preview's noise seeds."""


@dataclass
class PreviewResult:
    """What ``preview`` wrote and, for the synthetic squares, what it read back."""

    path: Path | None
    """The GIF (None on ranks that do not write)."""
    captions: list[str]
    colour_right: int | None = None
    """Samples whose square has the caption's colour (None: data without colour labels)."""
    direction_right: int | None = None
    """Samples whose square moves the caption's way (of ``moving``)."""
    moving: int = 0
    """Captions that name a direction."""
    readings: list[tuple[str, str]] = field(default_factory=list)
    """(colour, direction) read from each sample."""


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
) -> PreviewResult:
    """Sample ``indices``' captions (every rank of a context-parallel group together), write
    the GIF when ``write``, and read the squares back when the data are the synthetic set."""
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
        )
        for j, k in enumerate(ks):
            out[k] = x[j].float().cpu()
    generated = [out[k] for k in range(len(samples))]
    captions = [s["caption"] for s in samples]
    path = None
    if write:
        clips = []
        for g, s in zip(generated, samples, strict=True):
            clips += [g, s["latents"].float()]
        path = latents_to_gif(_side_by_side(clips), out_path)
    result = PreviewResult(path=path, captions=captions)
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


def _side_by_side(clips: list[torch.Tensor]) -> Any:
    """Clips of different sizes as one ``[B, C, T, H, W]`` batch is not possible; the GIF
    writer takes a list of ``[C, T, H, W]`` clips padded to the largest (background 0)."""
    c = clips[0].shape[0]
    t = max(x.shape[1] for x in clips)
    h = max(x.shape[2] for x in clips)
    w = max(x.shape[3] for x in clips)
    out = torch.zeros(len(clips), c, t, h, w)
    for i, x in enumerate(clips):
        _, ti, hi, wi = x.shape
        out[i, :, :ti, :hi, :wi] = x
        out[i, :, ti:, :hi, :wi] = x[:, -1:]  # shorter clips hold their last frame
    return out
