"""The quickstart's synthetic latent set: coloured squares moving across 16-channel latents.

A sample's latents are written directly: every cell holds
``colour_basis(C) @ (2 * rgb - 1) * sqrt(C / 3)`` for the RGB colour of what covers it (a
dark background, or the square). Each set carries the VAE of these latents in ``vae/``
(:mod:`~longboat.diffusion.data.squares_vae`, written when diffusers is installed): its
decoder paints each cell as an 8x8 block of its colour, so the training run's previews are
decoded video, and its encoder gives the latents back from that video. A square of side ``max(2, 3/8 * min(H, W))`` starts centred (moved by a
seeded offset of at most ``start_jitter`` cells, or anywhere with -1) and moves one latent cell
per latent frame (wrapping around the edges).

Sample ``i`` has colour ``i % 4`` (red, green, blue, yellow), direction ``(i // 4) % 4``
(left, right, up, down) and shape ``shapes[(i // 16) % len(shapes)]``; its caption is
``a red square moving left`` (``a red square`` for one-frame samples). The text embeddings
are deterministic pseudo embeddings of the caption's words (:func:`caption_embedding`), so a
tiny DiT learns colour and direction from them through cross-attention.

The held-out set (:func:`eval_set_config`) is the same generator with another seed: the same
captions and shapes, other starting offsets. :func:`read_square` reads colour and direction
back from latents (a generated sample), so a preview can be checked against its caption.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longboat.diffusion.data.empty_caption import read_empty_caption, write_empty_caption
from longboat.diffusion.data.errors import DataError
from longboat.diffusion.data.preview import colour_basis
from longboat.diffusion.data.schema import SyntheticSquaresDataConfig
from longboat.diffusion.data.shards import (
    MANIFEST,
    SHARD_DIR,
    LatentRecord,
    new_manifest,
    read_manifest,
    write_manifest,
    write_shard,
)

__all__ = [
    "COLOURS",
    "DIRECTIONS",
    "SquareReading",
    "caption_embedding",
    "eval_set_config",
    "generate_squares",
    "read_square",
    "square_latents",
    "square_record",
]

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
}
DIRECTIONS: dict[str, tuple[int, int]] = {
    "left": (0, -1),
    "right": (0, 1),
    "up": (-1, 0),
    "down": (1, 0),
}
"""Per-frame (dy, dx) of each direction."""
BACKGROUND = (0.125, 0.125, 0.125)
GENERATOR_VERSION = 1
SAMPLES_PER_SHARD = 64
VAE_DIR = "vae"
"""The set's VAE, beside its shards."""


def _seed(*parts: object) -> int:
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _side(h: int, w: int) -> int:
    return max(2, round(3 * min(h, w) / 8))


def caption_embedding(caption: str, text_dim: int) -> torch.Tensor:
    """``[words, text_dim]`` float32: per word a unit-variance vector seeded by the word, plus
    half a vector seeded by its position (the same on every machine)."""
    words = caption.lower().split()
    if not words:
        raise ValueError("caption_embedding needs at least one word")
    rows = [
        np.random.default_rng(_seed("word", w)).standard_normal(text_dim)
        + 0.5 * np.random.default_rng(_seed("position", k)).standard_normal(text_dim)
        for k, w in enumerate(words)
    ]
    return torch.from_numpy(np.stack(rows)).float()


def empty_caption_embedding(text_dim: int) -> torch.Tensor:
    """``[1, text_dim]`` float32: the empty caption, no word, half the first position's
    vector (what :func:`caption_embedding` adds to a first word)."""
    row = 0.5 * np.random.default_rng(_seed("position", 0)).standard_normal(text_dim)
    return torch.from_numpy(row[None]).float()


def square_latents(
    shape: tuple[int, int, int],
    colour: str,
    direction: str,
    *,
    channels: int = 16,
    start: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """``[channels, T, H, W]`` float32 latents of one moving square (see the module doc)."""
    t, h, w = shape
    side = _side(h, w)
    dy, dx = DIRECTIONS[direction]
    rgb = np.empty((t, h, w, 3))
    rgb[:] = BACKGROUND
    for f in range(t):
        y0, x0 = (start[0] + dy * f) % h, (start[1] + dx * f) % w
        ys = (y0 + np.arange(side)) % h
        xs = (x0 + np.arange(side)) % w
        rgb[f][np.ix_(ys, xs)] = COLOURS[colour]
    lat = np.einsum("ck,thwk->cthw", colour_basis(channels), 2.0 * rgb - 1.0)
    return torch.from_numpy(lat * math.sqrt(channels / 3)).float()


def square_record(i: int, cfg: SyntheticSquaresDataConfig) -> LatentRecord:
    """Sample ``i`` of the set ``cfg`` describes."""
    colour = list(COLOURS)[i % len(COLOURS)]
    direction = list(DIRECTIONS)[(i // len(COLOURS)) % len(DIRECTIONS)]
    t, h, w = (int(v) for v in cfg.shapes[(i // 16) % len(cfg.shapes)])
    rng = np.random.default_rng(_seed("start", cfg.seed, i))
    if cfg.start_jitter < 0:
        start = (int(rng.integers(h)), int(rng.integers(w)))
    else:
        side, j = _side(h, w), cfg.start_jitter
        dy, dx = (int(v) for v in rng.integers(-j, j + 1, size=2))
        start = ((h - side) // 2 + dy, (w - side) // 2 + dx)
    caption = f"a {colour} square" + (f" moving {direction}" if t > 1 else "")
    return LatentRecord(
        latents=square_latents(
            (t, h, w), colour, direction, channels=cfg.latent_channels, start=start
        ),
        text_embeds=caption_embedding(caption, cfg.text_dim),
        caption=caption,
        source=f"synthetic_squares/{i}",
        frames=1 + 4 * (t - 1),
        height=8 * h,
        width=8 * w,
        fps=16.0 if t > 1 else 0.0,
        extra={"colour": colour, "direction": direction if t > 1 else "", "start": list(start)},
    )


def _write_vae(root: Path, channels: int) -> bool:
    """Write the set's VAE (``<root>/vae``) when diffusers is installed; whether it is there."""
    import importlib.util

    vae = root / VAE_DIR
    if (vae / "config.json").is_file():
        return True
    if importlib.util.find_spec("diffusers") is None:
        return False
    from longboat.diffusion.data.squares_vae import build_squares_vae

    build_squares_vae(vae, channels)
    return True


def _options(cfg: SyntheticSquaresDataConfig) -> dict[str, Any]:
    return {
        "generator": "synthetic_squares",
        "generator_version": GENERATOR_VERSION,
        "num_samples": cfg.num_samples,
        "shapes": [[int(v) for v in s] for s in cfg.shapes],
        "latent_channels": cfg.latent_channels,
        "text_dim": cfg.text_dim,
        "seed": cfg.seed,
        "start_jitter": cfg.start_jitter,
    }


def generate_squares(cfg: SyntheticSquaresDataConfig, *, prefix: str = "data") -> Path:
    """Write the set to ``cfg.out_dir`` unless it is there already with these settings; returns
    the directory (a latent dataset)."""
    cfg.validate(prefix)
    root = Path(cfg.out_dir)
    options = _options(cfg)
    if (root / MANIFEST).is_file():
        m = read_manifest(root)
        if m["complete"] and m["options"] == options:
            if read_empty_caption(root) is None:  # a set written before it carried one
                write_empty_caption(root, empty_caption_embedding(cfg.text_dim))
            _write_vae(root, cfg.latent_channels)  # likewise
            return root
        if m["options"].get("generator") != "synthetic_squares":
            raise DataError(
                f"{root}: holds a dataset that is not a synthetic_squares set; point "
                f"{prefix}.out_dir at another folder"
            )
    # Drop the old manifest first: until the new one is written nothing here looks valid.
    (root / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(root / SHARD_DIR, ignore_errors=True)
    shutil.rmtree(root / VAE_DIR, ignore_errors=True)
    vae = "vae/ (squares_vae: draws the latents)" if _write_vae(root, cfg.latent_channels) else None
    manifest = new_manifest(
        latent_channels=cfg.latent_channels,
        text_dim=cfg.text_dim,
        dtype="float32",
        encoders={
            "vae": vae or "none (latents written directly)",
            "text_encoder": "caption_embedding",
        },
        options=options,
    )
    write_empty_caption(root, empty_caption_embedding(cfg.text_dim))
    records = [square_record(i, cfg) for i in range(cfg.num_samples)]
    for k, start in enumerate(range(0, len(records), SAMPLES_PER_SHARD)):
        info = write_shard(root, k, records[start : start + SAMPLES_PER_SHARD], "float32")
        manifest["shards"].append(info.to_json())
    manifest["complete"] = True
    write_manifest(root, manifest)
    return root


def eval_set_config(cfg: SyntheticSquaresDataConfig) -> SyntheticSquaresDataConfig | None:
    """The held-out set of ``cfg`` (None with ``num_eval_samples=0``): ``num_eval_samples``
    samples by the same rules, starts drawn with the seed ``seed + 1``, written to
    ``eval_out_dir`` (default ``<out_dir>_eval``)."""
    if cfg.num_eval_samples < 1:
        return None
    root = Path(cfg.out_dir)
    out = cfg.eval_out_dir or str(root.with_name(root.name + "_eval"))
    return dataclasses.replace(
        cfg, out_dir=out, num_samples=cfg.num_eval_samples, seed=cfg.seed + 1, num_eval_samples=0
    )


@dataclass(frozen=True)
class SquareReading:
    """What :func:`read_square` sees in latents of one square."""

    colour: str
    """The named colour nearest to the square's mean colour; ``none`` when no square stands
    out from the background (a blank or noisy sample)."""
    direction: str
    """``left`` / ``right`` / ``up`` / ``down`` / ``still`` / ``other``: the most frequent
    frame-to-frame move of the square (``""`` for one frame)."""
    positions: tuple[tuple[int, int], ...] = ()
    """The square's top-left cell in each frame."""


_MOVES = {"still": (0, 0), **DIRECTIONS}
_MIN_CONTRAST = 0.5
"""Least mean distance from the background (in ``2 rgb - 1`` units) of the square's cells
above the other cells' for a square to be read (a drawn square: 1.8 to 2.5)."""


def read_square(latents: torch.Tensor | np.ndarray) -> SquareReading:
    """Colour and motion of the square in ``[C, T, H, W]`` latents (module doc's colour basis).

    Each cell's distance from the background colour is a map per frame; the square is the
    ``side x side`` box (wrapping around the edges, as the squares do) with the largest mean
    distance in that frame. Its colour is the mean colour of the boxes over all frames, named
    by the nearest of ``COLOURS`` (``none`` when the boxes do not stand out by
    ``_MIN_CONTRAST``). Each move between frames is the wrapped shift of the box, named as a
    direction (``still`` when it stays, ``other`` for any other shift); the direction is the
    most frequent move (ties: the first of still, left, right, up, down).
    """
    x = np.asarray(torch.as_tensor(latents).detach().float().cpu(), dtype=np.float64)
    if x.ndim != 4:
        raise ValueError(f"latents of shape {x.shape}: expected [C, T, H, W]")
    c, t, h, w = x.shape
    side = _side(h, w)
    colour = np.einsum("ck,cthw->thwk", colour_basis(c), x) / math.sqrt(c / 3)  # 2 rgb - 1
    dist = np.linalg.norm(colour - (2.0 * np.asarray(BACKGROUND) - 1.0), axis=-1)  # [T, H, W]
    # box[f, y, x]: sum of dist over the side x side box whose top-left cell is (y, x)
    box = sum(np.roll(dist, (-i, -j), axis=(1, 2)) for i in range(side) for j in range(side))
    positions, inside, picked = [], np.zeros_like(dist, dtype=bool), []
    for f in range(t):
        y, xx = np.unravel_index(int(np.argmax(box[f])), (h, w))
        positions.append((int(y), int(xx)))
        ys, xs = (y + np.arange(side)) % h, (xx + np.arange(side)) % w
        inside[f][np.ix_(ys, xs)] = True
        picked.append(colour[f][np.ix_(ys, xs)].reshape(-1, 3))
    rgb = (np.concatenate(picked).mean(axis=0) + 1.0) / 2.0
    name = min(COLOURS, key=lambda n: float(np.sum((np.asarray(COLOURS[n]) - rgb) ** 2)))
    outside = dist[~inside].mean() if (~inside).any() else 0.0
    if dist[inside].mean() - outside < _MIN_CONTRAST:
        name = "none"
    if t == 1:
        return SquareReading(colour=name, direction="", positions=tuple(positions))
    votes = dict.fromkeys([*_MOVES, "other"], 0)
    for (y0, x0), (y1, x1) in itertools.pairwise(positions):
        dy = (y1 - y0 + h // 2) % h - h // 2
        dx = (x1 - x0 + w // 2) % w - w // 2
        move = next((m for m, d in _MOVES.items() if d == (dy, dx)), "other")
        votes[move] += 1
    direction = max(votes, key=lambda m: votes[m])
    return SquareReading(colour=name, direction=direction, positions=tuple(positions))
