"""Helpers the LeRobot parity tests share (``lerobot_parity/``): random weight perturbation
and one training loss + one sampled action chunk from LeRobot's policy and from ours, both
fed the same noise and time."""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import torch


def perturb(module: torch.nn.Module, seed: int) -> None:
    """Add N(0, 0.05^2) noise (seeded) to every parameter of ``module``, so zero-initialised
    weights (adaRMS denses, norms, heads) take part in the comparison."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def lerobot_loss_and_actions(
    policy: torch.nn.Module,
    make_batch: Callable[[], dict[str, torch.Tensor]],
    noise: torch.Tensor,
    time: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(training loss, action chunk) of a LeRobot flow-matching ``policy`` (in eval mode) on a
    fresh ``make_batch()`` each, its noise and time draws replaced by ``noise`` / ``time``."""
    policy.eval()
    with (
        mock.patch.object(policy.model, "sample_noise", lambda shape, device: noise),
        mock.patch.object(policy.model, "sample_time", lambda b, device: time),
    ):
        loss, _ = policy.forward(make_batch())
        actions = policy.predict_action_chunk(make_batch())
    return loss.detach(), actions


def our_loss_and_actions(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], noise: torch.Tensor, action_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(training loss, action chunk cut to ``action_dim``) of our ``model`` (in eval mode) on
    ``batch`` (which carries its noise and time), sampling from ``noise``."""
    model.eval()
    with torch.no_grad():
        loss = model(batch)["loss"]
        actions = model.predict_action(batch, noise=noise)[..., :action_dim]
    return loss, actions
