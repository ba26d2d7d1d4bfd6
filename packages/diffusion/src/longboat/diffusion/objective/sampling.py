"""Few-step Euler sampling of a flow-matching model (previews, the quickstart's GIF).

The schedule is Wan's: ``steps`` levels evenly spaced from 1 down to (not including) 0, shifted,
then a final 0: ``sigma_i = shift(1 - i / steps)``. Each step moves along the predicted
velocity, ``x <- x + (sigma_{i+1} - sigma_i) * v``, which is what diffusers'
``FlowMatchEulerDiscreteScheduler.step`` does given the same sigmas
(``set_timesteps(sigmas=...)``) and DiffSynth-Studio's Wan scheduler does with its defaults.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from longboat.diffusion.objective.flow_matching import ModelFn
from longboat.diffusion.objective.schedule import shift_sigmas

__all__ = ["euler_step", "sample", "sampling_sigmas"]


def sampling_sigmas(steps: int, shift: float) -> torch.Tensor:
    """``steps + 1`` noise levels (float32): ``shift(1 - i / steps)`` for ``i < steps``, then 0."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if not shift > 0:
        raise ValueError(f"shift={shift} must be > 0")
    base = 1.0 - torch.arange(steps, dtype=torch.float64) / steps
    return torch.cat([shift_sigmas(base, shift), torch.zeros(1, dtype=torch.float64)]).float()


def euler_step(
    x: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float
) -> torch.Tensor:
    """``x + (sigma_next - sigma) * velocity`` computed in float32, returned in ``x``'s dtype."""
    out = x.float() + (float(sigma_next) - float(sigma)) * velocity.float()
    return out.to(x.dtype)


@torch.no_grad()
def sample(
    model_fn: ModelFn,
    shape: tuple[int, ...] | torch.Size,
    text_embeds: torch.Tensor,
    text_mask: torch.Tensor,
    *,
    steps: int = 8,
    shift: float = 5.0,
    generator: torch.Generator | None = None,
    num_train_timesteps: int = 1000,
    guidance_scale: float = 1.0,
    negative_text_embeds: torch.Tensor | None = None,
    negative_text_mask: torch.Tensor | None = None,
    model_kwargs: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Latents of ``shape`` (``[B, C, T, H, W]``) generated from noise in ``steps`` Euler steps.

    The starting noise is drawn from ``generator`` (float32, on its device), so a seed gives
    the same sample on any latent dtype. ``guidance_scale > 1`` mixes in the velocity for
    ``negative_text_embeds`` / ``negative_text_mask`` (classifier-free guidance:
    ``v_neg + scale * (v - v_neg)``). ``model_fn`` as in
    :func:`~longboat.diffusion.objective.flow_matching.flow_matching_loss`.
    """
    if guidance_scale != 1.0 and (negative_text_embeds is None or negative_text_mask is None):
        raise ValueError(
            f"guidance_scale={guidance_scale} needs negative_text_embeds and negative_text_mask "
            "(e.g. the embedding of an empty caption); use guidance_scale=1 without them"
        )
    device = torch.device(device) if device is not None else text_embeds.device
    gen_device = generator.device if generator is not None else device
    x = torch.randn(tuple(shape), generator=generator, device=gen_device, dtype=torch.float32)
    x = x.to(device=device, dtype=dtype)
    sigmas = sampling_sigmas(steps, shift).tolist()
    kwargs = model_kwargs or {}
    for sigma, sigma_next in itertools.pairwise(sigmas):
        t = torch.full((x.shape[0],), sigma * num_train_timesteps, device=device)
        v = model_fn(x, t, text_embeds, text_mask, **kwargs)
        if guidance_scale != 1.0:
            v_neg = model_fn(x, t, negative_text_embeds, negative_text_mask, **kwargs)
            v = v_neg.float() + guidance_scale * (v.float() - v_neg.float())
        x = euler_step(x, v, sigma, sigma_next)
    return x
