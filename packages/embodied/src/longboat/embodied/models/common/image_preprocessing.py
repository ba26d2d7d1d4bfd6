"""Image preprocessing on tensors (any device, batched, no PIL):
resize shortest side -> random (train) / centre (eval) crop of a fraction, resized back ->
resize to multiples of the patch grid -> normalise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


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
    """Final height and width are floored to multiples of this (patch * unshuffle factor)."""
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel mean for normalisation (SigLIP: 0.5)."""
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel std for normalisation (SigLIP: 0.5)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.crop_fraction <= 1.0:
            raise ValueError(f"crop_fraction={self.crop_fraction} must be in (0, 1]")

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """Final (H, W) for an input of (height, width)."""
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


def _to_unit_float(images: Tensor) -> Tensor:
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


def preprocess_images(
    images: Tensor,
    cfg: ImagePreprocessConfig,
    *,
    train: bool,
    generator: torch.Generator | None = None,
) -> Tensor:
    """images [..., 3, H, W] uint8 or float in [0, 1] -> normalised float32 [..., 3, H', W'].

    Deterministic given ``generator`` (only the training crop is random)."""
    if images.dim() < 4 or images.shape[-3] != 3:
        raise ValueError(f"images must be [..., 3, H, W], got shape {tuple(images.shape)}")
    lead = images.shape[:-3]
    x = _to_unit_float(images.reshape(-1, *images.shape[-3:]))
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
