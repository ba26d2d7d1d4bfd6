"""Image preprocessing on tensors (any device, batched, no PIL):
resize shortest side -> random (train) / centre (eval) crop of a fraction, resized back ->
resize to multiples of the patch grid -> normalise.

Two ways to resample (``ImagePreprocessConfig.resample``): ``bilinear``, antialiased bilinear
resizes and an affine crop on float frames; ``isaac``, Isaac-GR00T N1.6's processor on uint8
frames, pixel for pixel (``isaac_frames``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from longboat.embodied.models.common.resample import area_resize, bicubic_resize

RESAMPLE = ("bilinear", "isaac")


@dataclass(kw_only=True)
class ImagePreprocessConfig:
    """How camera frames become ViT input."""

    resize_shortest: int | None = 256
    """Resize so the shorter side has this many pixels (None: keep)."""
    pad_to_square: int | None = None
    """openpi's ``resize_with_pad``: fit the longer side to this many pixels keeping the
    aspect ratio and pad (black) to a square; replaces ``resize_shortest`` when set."""
    crop_fraction: float = 0.95
    """Crop this fraction of each side (random in training, centred in eval), then resize
    back; 1.0 disables."""
    multiple_of: int = 28
    """Final height and width are multiples of this (patch * unshuffle factor): floored
    (``bilinear``) or rounded to the nearest (``isaac``, Eagle's ``smart_resize``)."""
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel mean for normalisation (SigLIP: 0.5)."""
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel std for normalisation (SigLIP: 0.5)."""
    resample: str = "bilinear"
    """``bilinear``: float frames, antialiased bilinear resizes, an affine crop per image;
    ``isaac``: Isaac-GR00T N1.6's processor on uint8 frames (albumentations'
    ``SmallestMaxSize`` with OpenCV ``INTER_AREA``, a crop of ``int(side * crop_fraction)``
    pixels at an integer offset, random per sample in training and the same for all its
    cameras, centred in eval, ``INTER_AREA`` back, then Pillow bicubic to Eagle's
    ``smart_resize`` size: each side rounded to the nearest multiple of ``multiple_of``)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.crop_fraction <= 1.0:
            raise ValueError(f"crop_fraction={self.crop_fraction} must be in (0, 1]")
        if self.resample not in RESAMPLE:
            raise ValueError(f"resample={self.resample!r} must be one of {', '.join(RESAMPLE)}")
        if self.resample == "isaac" and self.pad_to_square is not None:
            raise ValueError("resample='isaac' resizes the shortest side; unset pad_to_square")

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """Final (H, W) for an input of (height, width)."""
        if self.resample == "isaac":
            return isaac_sizes(height, width, self)[-1]
        if self.pad_to_square is not None:
            h = w = self.pad_to_square
        else:
            h, w = _shortest_side_size(height, width, self.resize_shortest)
        m = self.multiple_of
        if h < m or w < m:
            raise ValueError(
                f"image of {height}x{width} becomes {h}x{w}, smaller than multiple_of={m}; "
                "raise resize_shortest or use larger images"
            )
        return h // m * m, w // m * m


_EAGLE_MIN_PIXELS = 4 * 28 * 28
_EAGLE_MAX_PIXELS = 4096 * 28 * 28
_EAGLE_MAX_SIDE = 500 * 14


def smallest_max_size(height: int, width: int, size: int | None) -> tuple[int, int]:
    """albumentations' ``SmallestMaxSize``: both sides scaled by ``size / shorter side``
    and rounded (Python's ``round``); unchanged when that scale is 1 or ``size`` is None."""
    if size is None:
        return height, width
    scale = size / float(min(height, width))
    if scale == 1.0:
        return height, width
    return round(height * scale), round(width * scale)


def eagle_smart_resize(height: int, width: int, factor: int) -> tuple[int, int]:
    """The Eagle processor's ``smart_resize``: each side rounded to the nearest multiple of
    ``factor`` (at least ``factor``, at most 7000), then scaled into [4, 4096] * 28**2
    pixels when outside it."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {height}x{width} is more than 200 times wider than tall")
    h = min(max(factor, round(height / factor) * factor), _EAGLE_MAX_SIDE)
    w = min(max(factor, round(width / factor) * factor), _EAGLE_MAX_SIDE)
    if h * w > _EAGLE_MAX_PIXELS:
        beta = math.sqrt(h * w / _EAGLE_MAX_PIXELS)
        h, w = math.floor(h / beta / factor) * factor, math.floor(w / beta / factor) * factor
    elif h * w < _EAGLE_MIN_PIXELS:
        beta = math.sqrt(_EAGLE_MIN_PIXELS / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def isaac_sizes(height: int, width: int, cfg: ImagePreprocessConfig) -> list[tuple[int, int]]:
    """The frame's (H, W) after each step of ``isaac_frames``: the shortest-side resize, the
    crop, the resize back, Eagle's final resize."""
    first = smallest_max_size(height, width, cfg.resize_shortest)
    crop = (max(1, int(first[0] * cfg.crop_fraction)), max(1, int(first[1] * cfg.crop_fraction)))
    back = smallest_max_size(*crop, cfg.resize_shortest)
    return [first, crop, back, eagle_smart_resize(*back, cfg.multiple_of)]


def _shortest_side_size(h: int, w: int, target: int | None) -> tuple[int, int]:
    if target is None:
        return h, w
    if h <= w:
        return target, max(1, round(w * target / h))
    return max(1, round(h * target / w)), target


def resize_with_pad(images: Tensor, size: int) -> Tensor:
    """[N, 3, H, W] in [0, 1] -> [N, 3, size, size]: longer side fit, centred, black padding.

    The arithmetic of openpi's PyTorch ``resize_with_pad_torch``, which LeRobot's pi0.5 runs
    on every camera frame: sizes floored from ``dim / ratio`` (a long side can come out one
    pixel short), plain bilinear without antialiasing, values clamped to [0, 1]. Training on
    frames resized any other way would not be what the exported policy sees in LeRobot."""
    h, w = images.shape[-2:]
    ratio = max(w / size, h / size)
    rh, rw = max(1, int(h / ratio)), max(1, int(w / ratio))
    if (rh, rw) != (h, w):
        images = F.interpolate(images, size=(rh, rw), mode="bilinear", align_corners=False)
        images = images.clamp(0.0, 1.0)
    top, left = (size - rh) // 2, (size - rw) // 2
    return F.pad(images, (left, size - rw - left, top, size - rh - top), value=0.0)


def unit_float(images: Tensor) -> Tensor:
    """Frames as float32 in [0, 1]: uint8 divided by 255, floats as they are."""
    if images.dtype == torch.uint8:
        return images.float() / 255.0
    if not images.is_floating_point():
        raise ValueError(f"images must be uint8 or float in [0, 1], got dtype {images.dtype}")
    return images.float()


_CONSTANTS: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}


def _channel_constants(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[Tensor, Tensor]:
    """Per-channel mean/std [1, 3, 1, 1] on ``device``, made once per device: a fresh
    ``torch.tensor(list, device=...)`` per call is a host->device copy (a sync, and not
    capturable in a CUDA graph)."""
    key = (mean, std, str(device))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = (
            torch.tensor(mean, device=device).view(1, 3, 1, 1),
            torch.tensor(std, device=device).view(1, 3, 1, 1),
        )
    return _CONSTANTS[key]


def crop_and_resize_back(
    images: Tensor, fraction: float, *, random: bool, generator: torch.Generator | None = None
) -> Tensor:
    """Crop ``fraction`` of each side at a per-image offset and resize back, as one batched
    affine resampling (bilinear)."""
    n = images.shape[0]
    if random:
        gen_device = generator.device if generator is not None else images.device
        u = torch.rand(n, 2, generator=generator, device=gen_device).to(images.device)
    else:
        u = torch.full((n, 2), 0.5, device=images.device)
    # In normalised coords the crop covers [-1 + 2u(1-f), -1 + 2u(1-f) + 2f] per axis.
    centre = -1.0 + 2.0 * u * (1.0 - fraction) + fraction
    theta = torch.zeros(n, 2, 3, device=images.device)
    theta[:, 0, 0] = fraction
    theta[:, 1, 1] = fraction
    theta[:, 0, 2] = centre[:, 1]  # x (width)
    theta[:, 1, 2] = centre[:, 0]  # y (height)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _to_uint8(images: Tensor) -> Tensor:
    if images.dtype == torch.uint8:
        return images
    if not images.is_floating_point():
        raise ValueError(f"images must be uint8 or float in [0, 1], got dtype {images.dtype}")
    # Frames decoded as uint8 and divided by 255 come back exactly.
    return (images.float() * 255.0).round_().clamp_(0, 255).to(torch.uint8)


def _crop(x: Tensor, top: Tensor, left: Tensor, size: tuple[int, int]) -> Tensor:
    """x [S, P, 3, H, W]: sample s cropped to ``size`` at (top[s], left[s])."""
    s, p, c, _, w = x.shape
    rows = top[:, None] + torch.arange(size[0], device=x.device)
    x = x.gather(3, rows[:, None, None, :, None].expand(s, p, c, size[0], w))
    cols = left[:, None] + torch.arange(size[1], device=x.device)
    return x.gather(4, cols[:, None, None, None, :].expand(s, p, c, size[0], size[1]))


def isaac_frames(
    images: Tensor,
    cfg: ImagePreprocessConfig,
    *,
    train: bool,
    generator: torch.Generator | None = None,
) -> Tensor:
    """[S, ..., 3, H, W] uint8 (or float in [0, 1]) -> uint8 [S, ..., 3, H', W'] as
    Isaac-GR00T N1.6's processor makes them (``ImagePreprocessConfig.resample``): the images
    of one sample (every index past the first) share the crop offset, as its replayed
    albumentations pipeline does."""
    lead = images.shape[:-3]
    h, w = images.shape[-2:]
    first, crop, back, final = isaac_sizes(h, w, cfg)
    x = area_resize(_to_uint8(images.reshape(-1, 3, h, w)), first)
    s = lead[0] if lead else 1
    x = x.reshape(s, -1, 3, *first)
    if crop != first:
        span = (first[0] - crop[0] + 1, first[1] - crop[1] + 1)
        if train:
            dev = generator.device if generator is not None else x.device
            top = torch.randint(0, span[0], (s,), generator=generator, device=dev).to(x.device)
            left = torch.randint(0, span[1], (s,), generator=generator, device=dev).to(x.device)
        else:
            top = torch.full((s,), (first[0] - crop[0]) // 2, device=x.device)
            left = torch.full((s,), (first[1] - crop[1]) // 2, device=x.device)
        x = _crop(x, top, left, crop)
    x = area_resize(x.reshape(-1, 3, *crop), back)
    x = bicubic_resize(x, final)
    return x.reshape(*lead, 3, *final)


def preprocess_images(
    images: Tensor,
    cfg: ImagePreprocessConfig,
    *,
    train: bool,
    generator: torch.Generator | None = None,
) -> Tensor:
    """images [..., 3, H, W] uint8 or float in [0, 1] -> normalised float32 [..., 3, H', W'].

    Deterministic given ``generator`` (only the training crop is random). With
    ``resample="isaac"`` the first dimension is the sample (its cameras share a crop)."""
    if images.dim() < 4 or images.shape[-3] != 3:
        raise ValueError(f"images must be [..., 3, H, W], got shape {tuple(images.shape)}")
    if cfg.resample == "isaac":
        x = isaac_frames(images, cfg, train=train, generator=generator).float()
        # transformers fuses the 1/255 rescale into the normalisation: (x - 255 m) / (255 s).
        mean, std = _channel_constants(
            tuple(255.0 * m for m in cfg.mean), tuple(255.0 * s for s in cfg.std), x.device
        )
        return (x - mean) / std
    lead = images.shape[:-3]
    x = unit_float(images.reshape(-1, *images.shape[-3:]))
    h, w = x.shape[-2:]
    if cfg.pad_to_square is not None:
        x = resize_with_pad(x, cfg.pad_to_square)
        rh = rw = cfg.pad_to_square
    else:
        rh, rw = _shortest_side_size(h, w, cfg.resize_shortest)
        if (rh, rw) != (h, w):
            x = F.interpolate(
                x, size=(rh, rw), mode="bilinear", antialias=True, align_corners=False
            )
    if cfg.crop_fraction < 1.0:
        x = crop_and_resize_back(x, cfg.crop_fraction, random=train, generator=generator)
    oh, ow = cfg.output_size(h, w)
    if (oh, ow) != (rh, rw):
        x = F.interpolate(x, size=(oh, ow), mode="bilinear", antialias=True, align_corners=False)
    mean, std = _channel_constants(tuple(cfg.mean), tuple(cfg.std), x.device)
    x = (x - mean) / std
    return x.reshape(*lead, 3, oh, ow)
