"""Rectified-flow (flow-matching) training loss as Wan trains it.

For clean latents ``x0`` and a noise level ``sigma`` (see
:mod:`~longboat.diffusion.objective.schedule`) the model gets
``x_t = (1 - sigma) * x0 + sigma * noise`` and the timestep ``sigma * num_train_timesteps``, and
predicts the velocity ``noise - x0``. Each sample's loss is the mean squared error over its
real latent elements (padding excluded), times its timestep weight; the batch loss is the mean
over samples, so every video counts once whatever its size or its batch's padding.

The noise levels and the noise come from one ``torch.Generator`` in a fixed order (levels
first, then each sample's noise), so a benchmark or a test replays a step exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from longboat.core.config.errors import ProblemCollector
from longboat.core.device.transfer import to_device
from longboat.diffusion.objective.schedule import bell_weights, draw_sigmas

__all__ = [
    "TIMESTEP_SAMPLINGS",
    "WEIGHTINGS",
    "FlowMatchingConfig",
    "ModelFn",
    "draw_noise",
    "flow_matching_loss",
    "timestep_weights",
]

TIMESTEP_SAMPLINGS = ("uniform", "logit_normal")
"""``timestep_sampling``: uniform (Wan) or logit-normal (SD3 / FLUX-style image models)."""
WEIGHTINGS = ("none", "bell")
"""``weighting``: no per-timestep weight, or DiffSynth-Studio's bell around mid noise."""

ModelFn = Callable[..., Any]
"""``model_fn(latents, timesteps, text_embeds, text_mask, **model_kwargs) -> velocity``:
latents ``[B, C, T, H, W]`` (or a list of ``[C, T, H, W]`` when packed), timesteps ``[B]``
float in ``[0, num_train_timesteps]``, text ``[B, L, D]`` with mask ``[B, L]``; the velocity
has the latents' shape (a list of the same shapes when packed)."""


@dataclass(kw_only=True)
class FlowMatchingConfig:
    """How training noise levels are drawn and weighted (defaults: Wan 2.1 / 2.2)."""

    shift: float = 5.0
    """Timestep shift ``sigma' = shift * sigma / (1 + (shift - 1) * sigma)``; > 1 trains more
    at high noise (Wan: 5; 1: no shift)."""
    timestep_sampling: str = "uniform"
    """``uniform`` (Wan) or ``logit_normal`` (image MMDiTs), before the shift."""
    logit_mean: float = 0.0
    """Mean of the normal whose sigmoid is ``u`` (``logit_normal`` only)."""
    logit_std: float = 1.0
    """Standard deviation of that normal (``logit_normal`` only)."""
    num_train_timesteps: int = 1000
    """The model's timestep scale: it sees ``sigma * num_train_timesteps``; also the number of
    levels of the training grid (``discrete_timesteps``) and of the bell's normalisation."""
    discrete_timesteps: bool = False
    """Draw ``uniform`` levels from the ``num_train_timesteps``-level grid (diffusers' and
    DiffSynth-Studio's training table) instead of continuously."""
    weighting: str = "bell"
    """Per-timestep loss weight: ``none`` or ``bell`` (DiffSynth-Studio's Wan weighting)."""

    def validate(self, prefix: str = "objective") -> None:
        """Raise one ``ConfigError`` naming every bad key (``<prefix>.<field>``)."""
        p = ProblemCollector()
        if not self.shift > 0:
            p.add(
                f"{prefix}.shift", "must be > 0", value=self.shift, fix="use 5 for Wan, 1 for none"
            )
        if self.timestep_sampling not in TIMESTEP_SAMPLINGS:
            p.add(
                f"{prefix}.timestep_sampling",
                "unknown timestep sampling",
                value=self.timestep_sampling,
                fix=f"use one of {', '.join(TIMESTEP_SAMPLINGS)}",
            )
        if not self.logit_std > 0:
            p.add(f"{prefix}.logit_std", "must be > 0", value=self.logit_std, fix="e.g. 1.0")
        if not isinstance(self.num_train_timesteps, int) or self.num_train_timesteps < 1:
            p.add(
                f"{prefix}.num_train_timesteps",
                "must be a positive integer",
                value=self.num_train_timesteps,
                fix="use 1000 (Wan, FLUX, SD3)",
            )
        if self.discrete_timesteps and self.timestep_sampling != "uniform":
            p.add(
                f"{prefix}.discrete_timesteps",
                "only applies to uniform sampling",
                value=self.discrete_timesteps,
                fix=f"set {prefix}.discrete_timesteps=false or {prefix}.timestep_sampling=uniform",
            )
        if self.weighting not in WEIGHTINGS:
            p.add(
                f"{prefix}.weighting",
                "unknown loss weighting",
                value=self.weighting,
                fix=f"use one of {', '.join(WEIGHTINGS)}",
            )
        p.raise_if_any()


def timestep_weights(sigmas: torch.Tensor, config: FlowMatchingConfig) -> torch.Tensor:
    """The loss weight of each noise level (float32, ones for ``weighting=none``)."""
    if config.weighting == "none":
        return torch.ones_like(sigmas, dtype=torch.float32)
    return bell_weights(
        sigmas, shift=config.shift, num_train_timesteps=config.num_train_timesteps
    ).to(sigmas.device)


def _noise_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    # Drawn on the generator's device in float32, so one seed gives the same noise for any
    # latent dtype (and on any device with a CPU generator).
    device = generator.device if generator is not None else x.device
    noise = torch.randn(x.shape, generator=generator, device=device, dtype=torch.float32)
    return to_device(noise, x.device, x.dtype)


def draw_noise(
    x0: torch.Tensor, config: FlowMatchingConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(sigmas, noise)`` ``flow_matching_loss`` draws for a padded batch ``x0`` from
    ``generator`` (the same draws in the same order), on ``x0``'s device: its ``drawn``."""
    sigmas = draw_sigmas(x0.shape[0], config, generator, device=x0.device)
    return sigmas, _noise_like(x0, generator)


def _expand(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def _per_sample_mse(
    pred: torch.Tensor, target: torch.Tensor, latent_mask: torch.Tensor | None
) -> torch.Tensor:
    err = (pred.float() - target.float()) ** 2  # [B, C, *grid]
    if latent_mask is None:
        return err.flatten(1).mean(dim=1)
    mask = latent_mask.to(err.device, torch.float32).unsqueeze(1)  # [B, 1, *grid]
    count = mask.flatten(1).sum(dim=1) * err.shape[1]
    if (count == 0).any():
        raise ValueError("latent_mask has a sample with no real latent positions")
    return (err * mask).flatten(1).sum(dim=1) / count


def flow_matching_loss(
    model_fn: ModelFn,
    x0: torch.Tensor | Sequence[torch.Tensor],
    text_embeds: torch.Tensor,
    text_mask: torch.Tensor,
    *,
    config: FlowMatchingConfig,
    generator: torch.Generator | None = None,
    latent_mask: torch.Tensor | None = None,
    model_kwargs: dict[str, Any] | None = None,
    drawn: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One flow-matching loss of ``model_fn`` on clean latents ``x0``.

    ``x0``: ``[B, C, T, H, W]`` (padded, with ``latent_mask [B, T, H, W]`` True on real
    positions) or a list of ``[C, T_i, H_i, W_i]`` (packed: each sample its own shape).
    ``text_embeds`` ``[B, L, D]`` / ``text_mask`` ``[B, L]`` go to the model unchanged, as do
    ``model_kwargs``. ``drawn``: the ``(sigmas, noise)`` of a padded batch drawn beforehand
    (``draw_noise``: the same draws; a CUDA-graph-captured step reads them as inputs) instead
    of drawing from ``generator``. Returns ``(loss, aux)``: the scalar weighted loss (float32) and, detached,
    ``sigmas``, ``timesteps``, ``weights`` and the unweighted ``sample_loss`` ``[B]``.
    """
    config.validate()
    packed = not isinstance(x0, torch.Tensor)
    batch = len(x0)
    if batch == 0:
        raise ValueError("flow_matching_loss got an empty batch")
    if packed and latent_mask is not None:
        raise ValueError("latent_mask is for padded batches; packed samples have no padding")
    if text_embeds.shape[0] != batch or text_mask.shape[0] != batch:
        raise ValueError(
            f"{batch} latent samples but text_embeds {tuple(text_embeds.shape)} / text_mask "
            f"{tuple(text_mask.shape)}: give one text per sample"
        )
    first = x0[0]
    if drawn is not None and packed:
        raise ValueError("drawn noise is for padded batches; packed samples draw their own")
    if drawn is not None:
        sigmas, noise = drawn
    else:
        sigmas = draw_sigmas(batch, config, generator, device=first.device)
    timesteps = sigmas * config.num_train_timesteps
    if packed:
        noise = [_noise_like(x, generator) for x in x0]
        x_t = [
            (1 - s) * x + s * n for x, s, n in zip(x0, sigmas.to(first.dtype), noise, strict=True)
        ]
        target = [n - x for x, n in zip(x0, noise, strict=True)]
    else:
        if drawn is None:
            noise = _noise_like(x0, generator)
        s = _expand(sigmas, x0)
        x_t = (1 - s) * x0 + s * noise
        target = noise - x0
    pred = model_fn(x_t, timesteps, text_embeds, text_mask, **(model_kwargs or {}))
    if packed:
        if len(pred) != batch:
            raise ValueError(f"the model returned {len(pred)} predictions for {batch} samples")
        sample_loss = torch.stack(
            [_per_sample_mse(p[None], t[None], None)[0] for p, t in zip(pred, target, strict=True)]
        )
    else:
        if pred.shape != target.shape:
            raise ValueError(
                f"the model's velocity has shape {tuple(pred.shape)}, the latents "
                f"{tuple(target.shape)}: it must predict one value per latent element"
            )
        sample_loss = _per_sample_mse(pred, target, latent_mask)
    weights = timestep_weights(sigmas, config).to(sample_loss.device)
    loss = (weights * sample_loss).mean()
    aux = {
        "sigmas": sigmas.detach(),
        "timesteps": timesteps.detach(),
        "weights": weights.detach(),
        "sample_loss": sample_loss.detach(),
    }
    return loss, aux
