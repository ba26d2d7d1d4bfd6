"""LLaVA-OneVision's "anyres" image geometry, shared by the processor and the model.

An image that is alone in its sample is seen twice: once squashed to one ``crop x crop``
view (the base) and once at the grid resolution (from ``image_grid_pinpoints``) that keeps
most of its pixels while wasting the fewest, resized into it with its aspect ratio kept,
centred on zero padding and cut into ``crop x crop`` tiles. The model lays the tiles'
features out as one feature map, cuts the padding's rows or columns off again, shrinks the
map bilinearly when it holds more than ``1.1**2 * max_tiles`` tiles' worth of features
(``vision_aspect_ratio = "anyres_max_<max_tiles>"``), and ends every row with the learned
``image_newline``; the base view's features come first. An image that shares its sample with
others is padded to a square (the mean colour) and seen once: its features then the newline.

Sizes are ``(height, width)`` in pixels throughout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

Pinpoints = Sequence[Sequence[int]]


def best_resolution(height: int, width: int, pinpoints: Pinpoints) -> tuple[int, int]:
    """The pinpoint ``(H, W)`` showing most of the image's pixels, then wasting fewest."""
    best: tuple[int, int] | None = None
    most, least_waste = 0, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        shown = min(int(width * scale) * int(height * scale), width * height)
        waste = pw * ph - shown
        if shown > most or (shown == most and waste < least_waste):
            most, least_waste, best = shown, waste, (int(ph), int(pw))
    if best is None:
        raise ValueError("image_grid_pinpoints is empty")
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """The image resized into ``target`` with its aspect ratio kept (one side fills it)."""
    th, tw = target
    sw, sh = tw / width, th / height
    if sw < sh:
        return min(math.ceil(height * sw), th), tw
    return th, min(math.ceil(width * sh), tw)


def tile_grid(height: int, width: int, pinpoints: Pinpoints, crop: int) -> tuple[int, int]:
    """``(rows, cols)`` of tiles the image is cut into."""
    bh, bw = best_resolution(height, width, pinpoints)
    return bh // crop, bw // crop


def unpadded_bounds(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` of the image inside a ``rows x cols`` feature map that
    holds it centred with padding (rows or columns of padding are cut)."""
    if width / height > cols / rows:
        kept = int(round(height * (cols / width), 7))
        pad = (rows - kept) // 2
        return pad, rows - pad, 0, cols
    kept = int(round(width * (rows / height), 7))
    pad = (cols - kept) // 2
    return 0, rows, pad, cols - pad


def max_tiles(vision_aspect_ratio: str) -> int:
    """``N`` of ``"anyres_max_N"``."""
    head, _, tail = vision_aspect_ratio.rpartition("_")
    if head != "anyres_max" or not tail.isdigit() or int(tail) < 1:
        raise ValueError(
            f"vision_aspect_ratio={vision_aspect_ratio!r}: expected 'anyres_max_<N>', N >= 1"
        )
    return int(tail)


def shrunk_size(rows: int, cols: int, grid: int, vision_aspect_ratio: str) -> tuple[int, int]:
    """The feature map's size after the ``anyres_max_N`` rule (unchanged when small enough)."""
    ratio = math.sqrt(rows * cols / (max_tiles(vision_aspect_ratio) * grid**2))
    if ratio > 1.1:
        return int(rows // ratio), int(cols // ratio)
    return rows, cols


def num_image_tokens(
    height: int, width: int, *, tiled: bool, grid: int, crop: int, pinpoints: Pinpoints,
    vision_aspect_ratio: str,
) -> int:  # fmt: skip
    """Placeholder tokens (feature rows) of one image of ``height x width`` pixels.

    ``grid``: the tower's patches per side of one crop; ``tiled``: the image is alone in its
    sample (anyres), else it is one padded square view.
    """
    if not tiled:
        return grid * grid + 1
    r, c = tile_grid(height, width, pinpoints, crop)
    top, bottom, left, right = unpadded_bounds(height, width, r * grid, c * grid)
    h, w = shrunk_size(bottom - top, right - left, grid, vision_aspect_ratio)
    return grid * grid + h * (w + 1)


def num_video_tokens(frames: int, grid: int) -> int:
    """Placeholder tokens of a video of ``frames`` frames (tower ``grid`` patches per side):
    each frame's features pooled to ``ceil(grid / 2)`` per side, then one newline."""
    return frames * (-(-grid // 2)) ** 2 + 1


def pack_image_features(
    features: torch.Tensor, height: int, width: int, newline: torch.Tensor, *, grid: int,
    crop: int, pinpoints: Pinpoints, vision_aspect_ratio: str,
) -> torch.Tensor:  # fmt: skip
    """``[crops, grid*grid, D]`` features of one image -> its ``[tokens, D]`` placeholder rows
    (base view first; one crop: that view then the newline)."""
    base = features[0]
    if features.shape[0] == 1:
        return torch.cat([base, newline[None].to(base.dtype)])
    r, c = tile_grid(height, width, pinpoints, crop)
    if features.shape[0] != r * c + 1:
        raise ValueError(
            f"an image of {height}x{width} is cut into {r}x{c} tiles but {features.shape[0] - 1} "
            "tile views came: the processor's pinpoints and crop size must be the model's"
        )
    d = features.shape[-1]
    fmap = features[1:].reshape(r, c, grid, grid, d).permute(4, 0, 2, 1, 3)
    fmap = fmap.reshape(d, r * grid, c * grid)
    top, bottom, left, right = unpadded_bounds(height, width, r * grid, c * grid)
    fmap = fmap[:, top:bottom, left:right]
    size = shrunk_size(fmap.shape[1], fmap.shape[2], grid, vision_aspect_ratio)
    if size != tuple(fmap.shape[1:]):
        fmap = F.interpolate(fmap[None], size=list(size), mode="bilinear")[0]
    ends = newline.to(fmap.dtype)[:, None, None].expand(d, fmap.shape[1], 1)
    fmap = torch.cat([fmap, ends], dim=2)
    return torch.cat([base, fmap.reshape(d, -1).transpose(0, 1)])
