"""The synthetic squares' VAE: a tiny ``AutoencoderKLWan`` whose weights draw the squares.

The quickstart's latents hold ``colour_basis(C) @ (2 rgb - 1) * sqrt(C / 3)`` per cell
(:mod:`~longboat.diffusion.data.synthetic`). :func:`build_squares_vae` writes a diffusers
``AutoencoderKLWan`` (Wan's 4x temporal and 8x spatial compression, 8 channels wide, one
residual block per resolution in the decoder, ``latents_mean`` 0 and ``latents_std`` 1, 43K
weights) whose weights are set, not learnt, so that

- ``decode`` paints every latent cell as an 8x8 block of its colour and every latent frame
  after the first as 4 video frames (``4 (T - 1) + 1`` frames out, as Wan's VAE), and
- ``encode`` of such a video gives back the latents (its mean; the log-variance is -30).

How: every residual branch and the attention's output projection are zero, so the blocks pass
their input through (a 1x1x1 shortcut copies channels where the width changes); the
convolutions copy channels at the tap of the current frame and pixel (the up- and
down-samplers' too, so blocks are repeated or picked). Only the input and output layers map:
the first convolution writes a constant ``K`` and the colour ``c`` and ``-c`` (``c = 2 rgb -
1``) into 7 channels; the output head's RMS norm then divides by about ``K`` (the colour's
share of the norm is below ``1e-5``), its gain multiplies ``K`` back, and the last
convolution takes ``silu(c) - silu(-c) = c``, which is exact for SiLU. The VAE is a drawing
tool for this one data set: it encodes any other video to the colour-basis projection of
its pixels, nothing more.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longboat.diffusion.data.preview import colour_basis

__all__ = ["build_squares_vae", "squares_vae"]

_K = 1000.0
"""The constant channel: the colour's relative share of the head's RMS norm is at most
``2 |c|^2 / K^2`` (below 1e-5 for colours in [-1, 1])."""
_LOGVAR = -30.0
"""The posterior's log-variance (diffusers' clamp floor): sampling returns the mean."""


def _copy(conv: torch.nn.Module, taps: tuple[int, ...], n: int, *, out_offset: int = 0) -> None:
    """Make ``conv`` copy its first ``n`` input channels to outputs ``out_offset..`` at the
    kernel position ``taps``."""
    w = conv.weight
    for c in range(min(n, w.shape[0] - out_offset, w.shape[1])):
        w[(out_offset + c, c, *taps)] = 1.0


def _set_blocks(vae: Any, carried: int) -> None:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample, WanResidualBlock

    for p in vae.parameters():
        p.zero_()
    for m in vae.modules():
        if isinstance(m, WanResidualBlock) and isinstance(m.conv_shortcut, torch.nn.Conv3d):
            _copy(m.conv_shortcut, (0, 0, 0), carried)
        elif isinstance(m, WanResample):
            conv = m.resample[1]
            # upsampling: the centre tap reads the nearest-upsampled pixel; downsampling
            # (padding right and below, stride 2): the top-left tap reads pixel (2y, 2x)
            _copy(conv, (1, 1) if m.mode.startswith("up") else (0, 0), carried)
            if m.mode == "upsample3d":  # both new frames: the current one
                _copy(m.time_conv, (2, 0, 0), carried)
                _copy(m.time_conv, (2, 0, 0), carried, out_offset=m.dim)
            elif m.mode == "downsample3d":  # the newest frame of the strided window
                _copy(m.time_conv, (2, 0, 0), carried)
        # A WanAttentionBlock with its output projection zero is the identity; the gains of
    # norms inside zeroed branches do not matter, the heads' are set below.


def _write_head_in(conv: torch.nn.Module, colour_of_input: np.ndarray) -> None:
    """First convolution: channel 0 = K, 1..3 = c, 4..6 = -c, where c = colour_of_input @ x
    at the current frame and pixel."""
    m = torch.from_numpy(colour_of_input).float()  # [3, in]
    conv.weight[1:4, :, 2, 1, 1] = m
    conv.weight[4:7, :, 2, 1, 1] = -m
    conv.bias[0] = _K


def _write_head_out(
    norm: torch.nn.Module, conv: torch.nn.Module, out_of_colour: np.ndarray
) -> None:
    """Output head: the RMS norm's gain undoes the division by about K; the last convolution
    reads ``silu(c) - silu(-c) = c`` and maps it by ``out_of_colour`` ([out, 3])."""
    width = norm.gamma.shape[0]
    norm.gamma[1:7] = _K / math.sqrt(width)
    m = torch.from_numpy(out_of_colour).float()  # [out, 3]
    conv.weight[: m.shape[0], 1:4, 2, 1, 1] = m
    conv.weight[: m.shape[0], 4:7, 2, 1, 1] = -m


@torch.no_grad()
def squares_vae(channels: int = 16) -> Any:
    """The ``AutoencoderKLWan`` of the module doc for ``channels`` latent channels."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=channels,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=0,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * channels,
        latents_std=[1.0] * channels,
    )
    carried = 7
    _set_blocks(vae, carried)
    basis = colour_basis(channels)  # latent = basis @ c * scale
    scale = math.sqrt(channels / 3)
    # decoder: latents -> c (the basis' columns are orthonormal) -> pixels 2 rgb - 1 = c
    _copy(vae.post_quant_conv, (0, 0, 0), channels)
    _write_head_in(vae.decoder.conv_in, basis.T / scale)
    # the upsamplers halve the width to 4: -c is dropped there and written again by the
    # last block's widening shortcut
    shortcut = vae.decoder.up_blocks[-1].resnets[0].conv_shortcut
    shortcut.weight[4:7, 1:4, 0, 0, 0] = -torch.eye(3)
    _write_head_out(vae.decoder.norm_out, vae.decoder.conv_out, np.eye(3))
    # encoder: pixels -> c -> mean latents; log-variance constant
    _copy(vae.quant_conv, (0, 0, 0), 2 * channels)
    _write_head_in(vae.encoder.conv_in, np.eye(3))
    _write_head_out(vae.encoder.norm_out, vae.encoder.conv_out, basis * scale)
    vae.encoder.conv_out.bias[channels:] = _LOGVAR
    return vae.eval()


def build_squares_vae(out_dir: str | Path, channels: int = 16) -> Path:
    """Save :func:`squares_vae` (``config.json`` + safetensors) to ``out_dir``; returns it."""
    out = Path(out_dir)
    squares_vae(channels).save_pretrained(out)
    return out
