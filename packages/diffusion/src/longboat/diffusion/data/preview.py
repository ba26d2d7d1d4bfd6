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

__all__ = ["caption_strip", "colour_basis", "latents_to_gif", "latents_to_rgb", "write_sheet"]

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


_CAPTION_LINE = 12
"""Pixel height of a caption line (PIL's built-in bitmap font)."""


def _wrap(text: str, width_px: int, font: object) -> list[str]:
    from PIL import Image, ImageDraw

    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    lines: list[str] = []
    for word in text.split():
        trial = f"{lines[-1]} {word}" if lines else word
        if lines and draw.textlength(trial, font=font) <= width_px:
            lines[-1] = trial
        else:
            lines.append(word)
    return lines or [""]


def caption_strip(text: str, width: int, lines: int | None = None) -> np.ndarray:
    """uint8 ``[h, width, 3]``: ``text`` in black on white, wrapped to ``width`` pixels
    (``lines`` lines tall when given, else as many as the text needs)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    wrapped = _wrap(text, width - 4, font)
    n = len(wrapped) if lines is None else lines
    img = Image.new("RGB", (width, 4 + _CAPTION_LINE * n), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for i, line in enumerate(wrapped[:n]):
        draw.text((2, 2 + _CAPTION_LINE * i), line, fill=(0, 0, 0), font=font)
    return np.asarray(img)


def _upscale(clip: np.ndarray, factor: int) -> np.ndarray:
    return clip.repeat(factor, axis=1).repeat(factor, axis=2) if factor > 1 else clip


def write_sheet(
    cells: list[tuple[list[np.ndarray], str]],
    path: str | Path,
    *,
    columns: int = 4,
    min_height: int = 96,
    frame_ms: int = 125,
    video: str = "gif",
) -> Path:
    """A sheet of ``cells`` (each: uint8 ``[T, H, W, 3]`` clips shown side by side and a
    caption written under them), ``columns`` cells a row; small clips are scaled up (nearest,
    by a whole factor) to at least ``min_height`` pixels. An animated GIF when a clip has
    more than one frame (shorter clips hold their last frame; ``video="mp4"``: an H.264 mp4
    through PyAV instead), else a PNG; ``path``'s suffix is set accordingly. Returns the path
    written."""
    from PIL import Image

    if not cells:
        raise ValueError("a preview sheet needs at least one cell")
    tallest = max(c.shape[1] for clips, _ in cells for c in clips)
    factor = max(1, -(-min_height // tallest))
    gap = 2
    blocks = []
    for clips, caption in cells:
        big = [_upscale(c, factor) for c in clips]
        t = max(c.shape[0] for c in big)
        h = max(c.shape[1] for c in big)
        w = sum(c.shape[2] for c in big) + gap * (len(big) - 1)
        block = np.full((t, h, w, 3), 255, dtype=np.uint8)
        at = 0
        for c in big:
            held = np.concatenate([c, np.repeat(c[-1:], t - c.shape[0], axis=0)], axis=0)
            block[:, : c.shape[1], at : at + c.shape[2]] = held
            at += c.shape[2] + gap
        blocks.append((block, caption))
    from PIL import ImageFont

    t = max(b.shape[0] for b, _ in blocks)
    cell_w = max(max(b.shape[2] for b, _ in blocks), 120)
    font = ImageFont.load_default()
    lines = max(len(_wrap(c, cell_w - 4, font)) for _, c in blocks)
    cell_h = max(b.shape[1] for b, _ in blocks) + 4 + _CAPTION_LINE * lines
    rows = -(-len(blocks) // columns)
    cols = min(columns, len(blocks))
    sheet = np.full((t, rows * (cell_h + gap), cols * (cell_w + gap), 3), 255, dtype=np.uint8)
    for i, (block, caption) in enumerate(blocks):
        y, x = (i // columns) * (cell_h + gap), (i % columns) * (cell_w + gap)
        held = np.concatenate([block, np.repeat(block[-1:], t - block.shape[0], axis=0)], axis=0)
        sheet[:, y : y + block.shape[1], x : x + block.shape[2]] = held
        strip = caption_strip(caption, cell_w, lines)
        sheet[:, y + block.shape[1] : y + block.shape[1] + strip.shape[0], x : x + cell_w] = strip
    out = Path(path).with_suffix(f".{video}" if t > 1 else ".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    if t > 1 and video == "mp4":
        return _write_mp4(sheet, out, fps=1000.0 / frame_ms)
    frames = [Image.fromarray(f) for f in sheet]
    if t > 1:
        frames[0].save(
            out, save_all=True, append_images=frames[1:], duration=frame_ms, loop=0, optimize=False
        )
    else:
        frames[0].save(out)
    return out


def _write_mp4(frames: np.ndarray, out: Path, *, fps: float) -> Path:
    """uint8 ``[T, H, W, 3]`` as an H.264 mp4 (sides padded white to even sizes, as 4:2:0
    chroma needs); written under a temporary name, then renamed."""
    import os
    from fractions import Fraction

    import av

    t, h, w, _ = frames.shape
    even = np.full((t, h + h % 2, w + w % 2, 3), 255, dtype=np.uint8)
    even[:, :h, :w] = frames
    tmp = out.with_name(out.name + ".tmp.mp4")
    with av.open(str(tmp), "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.height, stream.width, stream.pix_fmt = even.shape[1], even.shape[2], "yuv420p"
        stream.options = {"crf": "12"}
        for f in even:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, out)
    return out
