"""Noise levels of rectified flow: the shifted schedule, timestep sampling and loss weights.

A noise level ``sigma`` in ``[0, 1]`` mixes data and noise as ``(1 - sigma) * x0 + sigma * noise``;
the model sees the timestep ``sigma * num_train_timesteps``. Wan and SD3-style models spend
more training (and sampling) steps at high noise through the shift
``sigma' = shift * sigma / (1 + (shift - 1) * sigma)``, which keeps 0 and 1 fixed.

The training grid of ``N`` levels is ``sigma_k = shift(1 - k / N)`` for ``k = 0 .. N - 1``: the
table diffusers' ``FlowMatchEulerDiscreteScheduler`` builds at construction and the one
DiffSynth-Studio draws Wan training timesteps from.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from longboat.core.device.transfer import to_device

if TYPE_CHECKING:
    from longboat.diffusion.objective.flow_matching import FlowMatchingConfig

__all__ = ["bell_weights", "draw_sigmas", "shift_sigmas", "training_sigmas"]

_BELL_FLOOR = math.exp(-0.5)
"""The bell's value at ``sigma = 1`` (and 0), its lowest on ``[0, 1]``."""


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """``shift * sigma / (1 + (shift - 1) * sigma)`` elementwise (``shift=1``: unchanged)."""
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def training_sigmas(num_train_timesteps: int, shift: float) -> torch.Tensor:
    """The ``N``-level training grid ``shift(1 - k / N)``, ``k = 0 .. N - 1`` (float64, from 1
    down to ``shift(1 / N)``)."""
    k = torch.arange(num_train_timesteps, dtype=torch.float64)
    return shift_sigmas(1.0 - k / num_train_timesteps, shift)


def _bell(sigmas: torch.Tensor) -> torch.Tensor:
    # exp(-2 ((t - T/2) / T)^2) with t = sigma * T: a bell centred on mid noise.
    return torch.exp(-2.0 * (sigmas - 0.5) ** 2)


@lru_cache(maxsize=16)
def _bell_norm(num_train_timesteps: int, shift: float) -> float:
    grid = training_sigmas(num_train_timesteps, shift)
    return float((_bell(grid) - _BELL_FLOOR).mean())


def bell_weights(sigmas: torch.Tensor, *, shift: float, num_train_timesteps: int) -> torch.Tensor:
    """DiffSynth-style per-timestep loss weights of noise levels ``sigmas`` (float32).

    ``exp(-2 (sigma - 1/2)^2)`` minus its floor ``exp(-1/2)`` (so pure noise, ``sigma = 1``,
    weighs 0 and mid noise most), scaled to mean 1 over the training grid of
    ``num_train_timesteps`` levels with this ``shift``: on that grid the weights are exactly
    DiffSynth-Studio's Wan training weights.
    """
    w = (_bell(sigmas.double()) - _BELL_FLOOR) / _bell_norm(num_train_timesteps, float(shift))
    return w.clamp_min(0.0).float()


def draw_sigmas(
    batch: int,
    config: FlowMatchingConfig,
    generator: torch.Generator | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``batch`` training noise levels (float32, on ``device``), drawn with ``generator``.

    ``uniform``: ``u`` uniform on ``(0, 1]`` (or one of the ``N`` grid levels with
    ``discrete_timesteps``); ``logit_normal``: ``u = sigmoid(N(logit_mean, logit_std^2))``. Then
    ``sigma = shift(u)``. Exactly one draw of ``batch`` numbers is taken from ``generator``.
    """
    gen_device = generator.device if generator is not None else torch.device("cpu")
    if config.timestep_sampling == "logit_normal":
        z = torch.randn(batch, generator=generator, device=gen_device, dtype=torch.float64)
        u = torch.sigmoid(config.logit_mean + config.logit_std * z)
        sigmas = shift_sigmas(u, config.shift)
    elif config.discrete_timesteps:
        k = torch.randint(
            0, config.num_train_timesteps, (batch,), generator=generator, device=gen_device
        )
        sigmas = training_sigmas(config.num_train_timesteps, config.shift).to(gen_device)[k]
    else:
        u = 1.0 - torch.rand(batch, generator=generator, device=gen_device, dtype=torch.float64)
        sigmas = shift_sigmas(u, config.shift)
    return to_device(sigmas.float(), torch.device(device if device is not None else gen_device))
