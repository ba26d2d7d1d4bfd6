"""Flow-matching pieces: time sampling, interpolation conventions, masked MSE, Euler.

Two conventions (the published GR00T N1.x and pi0 / pi0.5 training code):
- GR00T: t = 0.999 * (1 - Beta(1.5, 1)); x_t = (1-t)*noise + t*action;
  target = action - noise; integrate t: 0 -> 1.
- pi0 / pi0.5: t = Beta(1.5, 1) * 0.999 + 0.001; x_t = t*noise + (1-t)*action;
  target = noise - action; integrate t: 1 -> 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def sample_beta_a1(
    alpha: float, n: int, *, device: torch.device, generator: torch.Generator | None = None
) -> Tensor:
    """Exact Beta(alpha, 1) samples by inverse CDF (CDF = x^alpha), so a ``generator``
    makes them reproducible on any device (torch.distributions.Beta takes none)."""
    gen_device = generator.device if generator is not None else device
    u = torch.rand(n, generator=generator, device=gen_device).to(device)
    return u.pow(1.0 / alpha)


def groot_time(
    n: int,
    *,
    device: torch.device,
    generator: torch.Generator | None = None,
    alpha: float = 1.5,
    noise_s: float = 0.999,
) -> Tensor:
    """GR00T training times in [0, 0.999], weighted toward 0 (noisy end)."""
    return noise_s * (1.0 - sample_beta_a1(alpha, n, device=device, generator=generator))


def pi0_time(
    n: int, *, device: torch.device, generator: torch.Generator | None = None, alpha: float = 1.5
) -> Tensor:
    """pi0/pi0.5 training times in [0.001, 1], weighted toward 1 (noisy end)."""
    return sample_beta_a1(alpha, n, device=device, generator=generator) * 0.999 + 0.001


def zero_padding(x: Tensor, mask: Tensor | None, key: str) -> Tensor:
    """``x`` with padded entries (``mask == 0``) zeroed, so their values never reach the loss.

    ``key`` names the batch entry in the error when the mask does not broadcast.
    """
    if mask is None:
        return x
    try:
        return x * mask.to(x.dtype).expand_as(x)
    except RuntimeError as e:
        raise ValueError(
            f"batch[{key!r}] of shape {tuple(mask.shape)} does not broadcast to {tuple(x.shape)}"
        ) from e


def training_draw(
    batch: dict[str, Tensor],
    generator: torch.Generator | None,
    sample_time: Callable[[int, torch.device], Tensor],
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """(action with padding zeroed, action mask, noise, time) for one training step.

    ``batch["noise"]`` / ``batch["time"]`` replace the random draws when present (loss
    alignment against a reference feeds both the same draws); ``sample_time(b, device)``
    is the model's own time distribution.
    """
    mask = batch.get("action_mask")
    action = zero_padding(batch["action"].float(), mask, "action_mask")
    noise = batch["noise"].float() if "noise" in batch else randn_like_gen(action, generator)
    if "time" in batch:
        t = batch["time"].float()
    else:
        t = sample_time(action.shape[0], action.device)
    return action, mask, noise, t


def pi0_training_inputs(
    batch: dict[str, Tensor], generator: torch.Generator | None, alpha: float
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor]:
    """(action, action mask, x_t, t, target velocity) of one pi0 / pi0.5 training step:
    ``training_draw`` with ``pi0_time`` (Beta ``alpha``), x_t = t*noise + (1-t)*action,
    target = noise - action."""
    action, mask, noise, t = training_draw(
        batch,
        generator,
        lambda b, device: pi0_time(b, device=device, generator=generator, alpha=alpha),
    )
    tt = t[:, None, None]
    x_t = tt * noise + (1 - tt) * action
    target = noise - action
    return action, mask, x_t, t, target


def flow_loss_outputs(
    pred: Tensor, target: Tensor, action: Tensor, mask: Tensor | None
) -> dict[str, Tensor]:
    """A flow-matching model's training outputs: {"loss" (MSE over the entries of
    ``action`` that ``mask`` keeps, broadcast to its shape), "pred_velocity",
    "target_velocity"}."""
    mask_full = None if mask is None else mask.expand_as(action)
    return {
        "loss": masked_mse(pred, target, mask_full),
        "pred_velocity": pred,
        "target_velocity": target,
    }


def masked_mse(pred: Tensor, target: Tensor, mask: Tensor | None) -> Tensor:
    """Mean squared error over the entries where mask is true (all when None)."""
    err = (pred.float() - target.float()).pow(2)
    if mask is None:
        return err.mean()
    m = mask.to(err.dtype)
    return (err * m).sum() / m.sum().clamp_min(1.0)


def euler_integrate(
    velocity: Callable[[Tensor, float], Tensor],
    x: Tensor,
    t_start: float,
    t_end: float,
    steps: int,
) -> Tensor:
    """x_{k+1} = x_k + dt * v(x_k, t_k), t_k = t_start + k * dt, dt = (t_end - t_start)/steps."""
    if steps < 1:
        raise ValueError(f"num_steps={steps} must be >= 1")
    dt = (t_end - t_start) / steps
    for k in range(steps):
        x = x + dt * velocity(x, t_start + k * dt)
    return x


def randn_like_gen(x: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard normal noise shaped like x, drawn from ``generator`` when given."""
    gen_device = generator.device if generator is not None else x.device
    return torch.randn(x.shape, generator=generator, device=gen_device, dtype=torch.float32).to(
        x.device
    )
