"""uint8 image resampling with the arithmetic of OpenCV's ``INTER_AREA`` and Pillow's
``BICUBIC``, on batched torch tensors (any device).

Isaac-GR00T N1.6 resizes camera frames with ``cv2.resize(..., INTER_AREA)`` (through
albumentations) and then with ``PIL.Image.resize`` (bicubic) inside the Eagle processor;
a model fine-tuned from its checkpoint should see the same pixels. Both libraries work on
uint8 with their own rounding, so these functions reproduce their integer and float32 steps
rather than a textbook filter:

- ``area_resize``: OpenCV 4.x ``INTER_AREA``. Shrinking on both axes by integer factors is a
  block mean (2x2: ``(sum + 2) >> 2``; other factors: ``sum * float32(1 / area)`` rounded
  half to even); other shrinking averages the exact pixel-area overlaps, accumulated in
  float32 row by row in OpenCV's order and rounded half to even; anything else (an axis
  grows) is OpenCV's "area-mode" bilinear: 11-bit fixed-point weights that are 0/1 except
  where a source pixel border falls inside a destination pixel, and its fixed-point vertical
  step ``((b0 * (S0 >> 4)) >> 16) + ((b1 * (S1 >> 4)) >> 16) + 2) >> 2``.
  (``F.interpolate(mode="area")`` equals it only for integer factors other than 2, and
  then only up to its float rounding.)
- ``bicubic_resize``: Pillow's separable resampling (support 2 scaled by the shrink factor,
  a = -0.5, coefficients normalised per output pixel and rounded to 22-bit fixed point;
  horizontal pass first, each pass rounded and clipped to uint8; an axis whose size does not
  change is not resampled).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

_FIXED_BITS = 11  # OpenCV's INTER_RESIZE_COEF_BITS
_PIL_BITS = 22  # Pillow's PRECISION_BITS for 8-bit images


def _check(images: Tensor) -> None:
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(
            f"expects uint8 images [N, C, H, W], got {images.dtype} {tuple(images.shape)}"
        )


_TABLES: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}


def _table(kind: str, src: int, dst: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """[dst, K] source indices and weights of one axis, built once per (kind, sizes, device):
    a fresh host->device copy per call would sync the stream (and not be capturable in a
    CUDA graph). Rows are zero-padded: a zero-weight term adds exactly 0 to a sum."""
    key = (kind, src, dst, str(device))
    if key not in _TABLES:
        if kind == "area":
            terms, dtype = _area_terms(src, dst), torch.float32
        elif kind == "pil":
            terms, dtype = _pil_terms(src, dst), torch.int64
        else:  # "linear_x" / "linear_y": OpenCV's area-mode bilinear
            terms, dtype = _area_linear_terms(src, dst, clamp_last=kind == "linear_x"), torch.int32
        k = max(len(t) for t in terms)
        idx = np.zeros((len(terms), k), dtype=np.int64)
        wts = np.zeros((len(terms), k), dtype=np.float64)
        for i, row in enumerate(terms):
            for j, (s, w) in enumerate(row):
                idx[i, j], wts[i, j] = s, w
        _TABLES[key] = (
            torch.from_numpy(idx).to(device),
            torch.tensor(wts, dtype=dtype).to(device),
        )
    return _TABLES[key]


def _area_terms(src: int, dst: int) -> list[list[tuple[int, float]]]:
    """Source pixels and float32 weights of each destination pixel when shrinking ``src`` to
    ``dst`` (OpenCV's ``computeResizeAreaTab``: a cell of ``src / dst`` source pixels, its
    partial border pixels weighted by their overlap; overlaps under 1e-3 dropped)."""
    scale = 1.0 / (dst / src)  # OpenCV inverts the destination/source ratio
    terms = []
    for d in range(dst):
        lo = d * scale
        hi = lo + scale
        cell = min(scale, src - lo)
        first, last = math.ceil(lo), math.floor(hi)
        last = min(last, src - 1)
        first = min(first, last)
        row = []
        if first - lo > 1e-3:
            row.append((first - 1, float(np.float32((first - lo) / cell))))
        row += [(s, float(np.float32(1.0 / cell))) for s in range(first, last)]
        if hi - last > 1e-3:
            row.append((last, float(np.float32(min(hi - last, 1.0, cell) / cell))))
        terms.append(row)
    return terms


def _area_shrink(x: Tensor, size: tuple[int, int]) -> Tensor:
    """Fractional shrink: float32 sums per source row over the columns, then over the rows,
    each in OpenCV's order; rounded half to even."""
    h, w = x.shape[-2:]
    src = x.float()
    cols, cw = _table("area", w, size[1], x.device)
    buf = torch.zeros(*src.shape[:-1], size[1], dtype=torch.float32, device=x.device)
    for j in range(cols.shape[1]):
        buf = buf + src[..., cols[:, j]] * cw[:, j]
    rows, rw = _table("area", h, size[0], x.device)
    out = torch.zeros(*src.shape[:-2], size[0], size[1], dtype=torch.float32, device=x.device)
    for j in range(rows.shape[1]):
        out = out + rw[:, j, None] * buf[..., rows[:, j], :]
    return out.round().clamp_(0, 255).to(torch.uint8)


def _area_block_mean(x: Tensor, fy: int, fx: int) -> Tensor:
    """Shrink by integer factors: the block sum, ``(sum + 2) >> 2`` for 2x2, else
    ``sum * float32(1 / area)`` rounded half to even."""
    n, c, h, w = x.shape
    blocks = x.to(torch.int32).reshape(n, c, h // fy, fy, w // fx, fx).sum((3, 5))
    if (fy, fx) == (2, 2):
        return ((blocks + 2) >> 2).to(torch.uint8)
    inv = float(np.float32(1.0) / np.float32(fy * fx))  # a Python float: no device copy
    return (blocks.float() * inv).round().clamp_(0, 255).to(torch.uint8)


def _area_linear_terms(src: int, dst: int, *, clamp_last: bool) -> list[list[tuple[int, int]]]:
    """OpenCV's area-mode bilinear taps along one axis: the two source pixels of each
    destination pixel (clamped to the image) and their 11-bit weights, which are 1 and 0
    unless a source pixel border falls inside the destination pixel. ``clamp_last``
    (columns): a tap from the last source pixel takes it whole; rows keep their weights."""
    inv = dst / src
    scale = 1.0 / inv
    one = np.float32(1 << _FIXED_BITS)
    terms = []
    for d in range(dst):
        s = math.floor(d * scale)
        f = np.float32((d + 1) - (s + 1) * inv)
        f = np.float32(0.0) if f <= 0 else np.float32(f - np.floor(f))
        if clamp_last and s >= src - 1:
            s, f = src - 1, np.float32(0.0)
        w0 = min(int(np.rint((np.float32(1.0) - f) * one)), 32767)  # saturate to int16
        w1 = min(int(np.rint(f * one)), 32767)
        terms.append([(min(s, src - 1), w0), (min(s + 1, src - 1), w1)])
    return terms


def _area_linear(x: Tensor, size: tuple[int, int]) -> Tensor:
    """OpenCV's ``INTER_AREA`` when an axis grows: fixed-point horizontal taps (int32 sums),
    then its fixed-point vertical step."""
    h, w = x.shape[-2:]
    cols, a = _table("linear_x", w, size[1], x.device)
    src = x.to(torch.int32)
    horiz = src[..., cols[:, 0]] * a[:, 0] + src[..., cols[:, 1]] * a[:, 1]
    rows, b = _table("linear_y", h, size[0], x.device)
    top = (b[:, 0, None] * (horiz[..., rows[:, 0], :] >> 4)) >> 16
    bottom = (b[:, 1, None] * (horiz[..., rows[:, 1], :] >> 4)) >> 16
    return ((top + bottom + 2) >> 2).clamp_(0, 255).to(torch.uint8)


def area_resize(images: Tensor, size: tuple[int, int]) -> Tensor:
    """uint8 [N, C, H, W] -> uint8 [N, C, *size] as ``cv2.resize(img, (w, h),
    interpolation=cv2.INTER_AREA)`` computes it (OpenCV 4.x, 8-bit images)."""
    _check(images)
    h, w = images.shape[-2:]
    oh, ow = int(size[0]), int(size[1])
    if (oh, ow) == (h, w):
        return images
    sy, sx = 1.0 / (oh / h), 1.0 / (ow / w)
    if sy >= 1 and sx >= 1:
        eps = np.finfo(np.float64).eps
        if abs(sy - round(sy)) < eps and abs(sx - round(sx)) < eps:
            return _area_block_mean(images, round(sy), round(sx))
        return _area_shrink(images, (oh, ow))
    return _area_linear(images, (oh, ow))


def _bicubic(x: float) -> float:
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _pil_terms(src: int, dst: int) -> list[list[tuple[int, int]]]:
    """Pillow's bicubic coefficients of each output pixel: support 2 widened by the shrink
    factor, normalised to sum 1, rounded to 22-bit fixed point (half away from zero)."""
    scale = src / dst
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    terms = []
    for d in range(dst):
        center = (d + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), src)
        ks = [_bicubic((s - center + 0.5) / filterscale) for s in range(lo, hi)]
        total = 0.0
        for k in ks:
            total += k
        if total != 0.0:
            ks = [k / total for k in ks]
        fixed = [
            int(k * (1 << _PIL_BITS) + (0.5 if k >= 0 else -0.5)) for k in ks
        ]  # int() truncates toward zero, as the C cast does
        terms.append(list(zip(range(lo, hi), fixed, strict=True)))
    return terms


def _pil_pass(x: Tensor, dst: int, dim: int) -> Tensor:
    """One Pillow resampling pass along ``dim`` (-1 columns, -2 rows) of int64 pixels."""
    idx, k = _table("pil", x.shape[dim], dst, x.device)
    acc = torch.full((), 1 << (_PIL_BITS - 1), dtype=torch.int64, device=x.device)
    for j in range(idx.shape[1]):
        if dim == -1:
            acc = acc + x[..., idx[:, j]] * k[:, j]
        else:
            acc = acc + x[..., idx[:, j], :] * k[:, j, None]
    return (acc >> _PIL_BITS).clamp_(0, 255)


def bicubic_resize(images: Tensor, size: tuple[int, int]) -> Tensor:
    """uint8 [N, C, H, W] -> uint8 [N, C, *size] as ``PIL.Image.resize((w, h),
    Image.BICUBIC)`` computes it for RGB images."""
    _check(images)
    h, w = images.shape[-2:]
    x = images.to(torch.int64)
    if int(size[1]) != w:
        x = _pil_pass(x, int(size[1]), -1)
    if int(size[0]) != h:
        x = _pil_pass(x, int(size[0]), -2)
    return x.to(torch.uint8)
