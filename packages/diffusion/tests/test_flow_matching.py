"""Flow matching against its formulas and against diffusers' FlowMatchEulerDiscreteScheduler."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from longboat.core.config.errors import ConfigError
from longboat.diffusion.objective import (
    FlowMatchingConfig,
    bell_weights,
    draw_sigmas,
    euler_step,
    flow_matching_loss,
    sample,
    sampling_sigmas,
    shift_sigmas,
    training_sigmas,
)

diffusers = pytest.importorskip("diffusers")
Scheduler = diffusers.FlowMatchEulerDiscreteScheduler


def _gen(seed: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _linear_model(x, t, text, mask, **_):
    """A velocity that depends on every input (latents, timestep, masked text)."""
    pooled = (text * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # [B, D]
    bias = pooled.mean(-1) + t / 1000.0  # [B]
    if isinstance(x, torch.Tensor):
        return 0.5 * x + bias.reshape(-1, *([1] * (x.dim() - 1)))
    return [0.5 * xi + b for xi, b in zip(x, bias, strict=True)]


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_shift_formula_and_training_grid_equal_diffusers(shift: float) -> None:
    s = torch.linspace(0, 1, 11, dtype=torch.float64)
    expected = torch.tensor([shift * v / (1 + (shift - 1) * v) for v in s.tolist()])
    assert torch.allclose(shift_sigmas(s, shift), expected.double(), atol=1e-12)
    # diffusers builds its training table at construction: the same 1000 shifted levels.
    sched = Scheduler(num_train_timesteps=1000, shift=shift)
    grid = training_sigmas(1000, shift)
    assert grid.shape == sched.sigmas.shape
    assert (grid.float() - sched.sigmas).abs().max().item() < 1e-6
    assert (grid.float() * 1000 - sched.timesteps).abs().max().item() < 1e-3  # t in [0, 1000]


def test_noisy_input_equals_diffusers_scale_noise() -> None:
    sched = Scheduler(num_train_timesteps=1000, shift=5.0)
    x0 = torch.randn(3, 4, 2, 4, 4, generator=_gen(1))
    noise = torch.randn(3, 4, 2, 4, 4, generator=_gen(2))
    idx = torch.tensor([0, 417, 999])
    t = sched.timesteps[idx]
    ref = sched.scale_noise(x0, t, noise)
    sigma = training_sigmas(1000, 5.0).float()[idx].reshape(-1, 1, 1, 1, 1)
    ours = (1 - sigma) * x0 + sigma * noise
    assert (ours - ref).abs().max().item() < 1e-6


@pytest.mark.parametrize(("steps", "shift"), [(1, 5.0), (4, 5.0), (8, 3.0), (6, 1.0)])
def test_sampling_sigmas_and_euler_steps_equal_diffusers(steps: int, shift: float) -> None:
    sched = Scheduler(num_train_timesteps=1000, shift=shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1].tolist())
    ours = sampling_sigmas(steps, shift)
    assert ours.shape == sched.sigmas.shape == (steps + 1,)
    assert (ours - sched.sigmas).abs().max().item() < 1e-6
    assert (ours[:-1] * 1000 - sched.timesteps).abs().max().item() < 1e-3
    x = torch.randn(2, 4, 3, 4, 4, generator=_gen(3))
    x_ref = x.clone()
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(x.shape, generator=_gen(10 + i))
        x_ref = sched.step(v, t, x_ref).prev_sample
        x = euler_step(x, v, ours[i].item(), ours[i + 1].item())
        assert (x - x_ref).abs().max().item() < 1e-6


def test_sample_replays_euler_by_hand() -> None:
    text = torch.randn(2, 5, 8, generator=_gen(4))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    shape = (2, 4, 3, 4, 6)
    out = sample(_linear_model, shape, text, mask, steps=4, shift=5.0, generator=_gen(7))
    x = torch.randn(shape, generator=_gen(7))
    sig = [5 * u / (1 + 4 * u) for u in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    for a, b in itertools.pairwise(sig):
        x = x + (b - a) * _linear_model(x, torch.full((2,), a * 1000), text, mask)
    assert (out - x).abs().max().item() < 1e-5
    # guidance: v_neg + g (v - v_neg)
    neg = torch.zeros(2, 1, 8)
    neg_mask = torch.ones(2, 1, dtype=torch.bool)
    guided = sample(
        _linear_model,
        shape,
        text,
        mask,
        steps=1,
        generator=_gen(7),
        guidance_scale=3.0,
        negative_text_embeds=neg,
        negative_text_mask=neg_mask,
    )
    x = torch.randn(shape, generator=_gen(7))
    v = _linear_model(x, torch.full((2,), 1000.0), text, mask)
    v_neg = _linear_model(x, torch.full((2,), 1000.0), neg, neg_mask)
    assert (guided - (x - (v_neg + 3.0 * (v - v_neg)))).abs().max().item() < 1e-5


def test_bell_weights_equal_diffsynth_formula_on_the_grid() -> None:
    # DiffSynth-Studio's Wan weights: y = exp(-2 ((t - 500) / 1000)^2) over the 1000 shifted
    # training timesteps t, minus its minimum, scaled to sum 1000.
    t = training_sigmas(1000, 5.0) * 1000
    y = torch.exp(-2 * ((t - 500) / 1000) ** 2)
    y = y - y.min()
    ref = y * (1000 / y.sum())
    ours = bell_weights(t / 1000, shift=5.0, num_train_timesteps=1000)
    assert (ours.double() - ref).abs().max().item() < 1e-6
    assert abs(ours.double().mean().item() - 1.0) < 1e-6
    assert ours[0].item() == 0.0  # pure noise weighs nothing
    mid = bell_weights(torch.tensor([0.5]), shift=5.0, num_train_timesteps=1000)
    assert mid.item() == pytest.approx((1 - math.exp(-0.5)) / (y.mean().item()), rel=1e-6)


def test_draw_sigmas_distributions() -> None:
    n = 20000
    u_cfg = FlowMatchingConfig(shift=5.0)
    s = draw_sigmas(n, u_cfg, _gen(0))
    u = 1 - torch.rand(n, generator=_gen(0), dtype=torch.float64)
    assert torch.allclose(s, (5 * u / (1 + 4 * u)).float(), atol=1e-7)
    d_cfg = FlowMatchingConfig(shift=5.0, discrete_timesteps=True)
    sd = draw_sigmas(n, d_cfg, _gen(0))
    k = torch.randint(0, 1000, (n,), generator=_gen(0))
    assert torch.equal(sd, training_sigmas(1000, 5.0).float()[k])
    ln = FlowMatchingConfig(
        shift=1.0, timestep_sampling="logit_normal", logit_mean=0.5, logit_std=0.8
    )
    sl = draw_sigmas(n, ln, _gen(0)).double()
    logit = torch.log(sl / (1 - sl))
    assert logit.mean().item() == pytest.approx(0.5, abs=0.03)
    assert logit.std().item() == pytest.approx(0.8, abs=0.03)
    z = torch.randn(n, generator=_gen(0), dtype=torch.float64)
    assert torch.allclose(sl, torch.sigmoid(0.5 + 0.8 * z), atol=1e-6)


def test_loss_is_the_formula_and_replays_with_the_generator() -> None:
    cfg = FlowMatchingConfig(shift=5.0, weighting="bell")
    x0 = torch.randn(3, 4, 2, 4, 4, generator=_gen(5))
    text = torch.randn(3, 6, 8, generator=_gen(6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, 3:] = False
    loss, aux = flow_matching_loss(_linear_model, x0, text, mask, config=cfg, generator=_gen(9))
    again, aux2 = flow_matching_loss(_linear_model, x0, text, mask, config=cfg, generator=_gen(9))
    assert loss.item() == again.item()
    assert torch.equal(aux["sigmas"], aux2["sigmas"])
    # Rebuild by hand: levels first, then the noise, from the same generator.
    g = _gen(9)
    u = 1 - torch.rand(3, generator=g, dtype=torch.float64)
    sigma = (5 * u / (1 + 4 * u)).float()
    noise = torch.randn(x0.shape, generator=g)
    s = sigma.reshape(-1, 1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * noise
    pred = _linear_model(x_t, sigma * 1000, text, mask)
    per = ((pred - (noise - x0)) ** 2).flatten(1).mean(1)
    w = bell_weights(sigma, shift=5.0, num_train_timesteps=1000)
    assert torch.allclose(aux["sigmas"], sigma)
    assert torch.allclose(aux["timesteps"], sigma * 1000)
    assert torch.allclose(aux["sample_loss"], per, rtol=1e-6)
    assert loss.item() == pytest.approx((w * per).mean().item(), rel=1e-6)
    plain, aux_n = flow_matching_loss(
        _linear_model,
        x0,
        text,
        mask,
        config=FlowMatchingConfig(weighting="none"),
        generator=_gen(9),
    )
    assert torch.equal(aux_n["weights"], torch.ones(3))
    assert plain.item() == pytest.approx(per.mean().item(), rel=1e-6)


def test_padding_is_masked_and_packed_equals_padded() -> None:
    cfg = FlowMatchingConfig(weighting="none")
    a = torch.randn(4, 2, 4, 6, generator=_gen(1))
    b = torch.randn(4, 3, 2, 4, generator=_gen(2))
    text = torch.randn(2, 3, 8, generator=_gen(3))
    mask = torch.ones(2, 3, dtype=torch.bool)

    def pointwise(x, t, txt, m, **_):  # no mixing across positions: padding cannot leak
        if isinstance(x, torch.Tensor):
            return torch.tanh(x) + (t / 1000).reshape(-1, 1, 1, 1, 1)
        return [torch.tanh(xi) + ti / 1000 for xi, ti in zip(x, t, strict=True)]

    padded = torch.zeros(2, 4, 3, 4, 6)
    padded[0, :, :2, :4, :6] = a
    padded[1, :, :3, :2, :4] = b
    lmask = torch.zeros(2, 3, 4, 6, dtype=torch.bool)
    lmask[0, :2, :4, :6] = True
    lmask[1, :3, :2, :4] = True
    _, aux_pad = flow_matching_loss(
        pointwise, padded, text, mask, config=cfg, generator=_gen(4), latent_mask=lmask
    )
    # The same levels and the padded noise's real part give each sample's loss by hand.
    g = _gen(4)
    u = 1 - torch.rand(2, generator=g, dtype=torch.float64)
    sigma = (5 * u / (1 + 4 * u)).float()
    noise = torch.randn(padded.shape, generator=g)
    for i, (x, sl) in enumerate(
        ((a, (slice(0, 2), slice(0, 4), slice(0, 6))), (b, (slice(0, 3), slice(0, 2), slice(0, 4))))
    ):
        n = noise[i][(slice(None), *sl)]
        xt = (1 - sigma[i]) * x + sigma[i] * n
        ref = ((torch.tanh(xt) + sigma[i] - (n - x)) ** 2).mean()
        assert aux_pad["sample_loss"][i].item() == pytest.approx(ref.item(), rel=1e-6)
    # Packed: a list of differently shaped samples.
    _, aux_pack = flow_matching_loss(pointwise, [a, b], text, mask, config=cfg, generator=_gen(4))
    g = _gen(4)
    torch.rand(2, generator=g, dtype=torch.float64)
    for i, x in enumerate((a, b)):
        n = torch.randn(x.shape, generator=g)
        xt = (1 - sigma[i]) * x + sigma[i] * n
        ref = ((torch.tanh(xt) + sigma[i] - (n - x)) ** 2).mean()
        assert aux_pack["sample_loss"][i].item() == pytest.approx(ref.item(), rel=1e-6)


def test_loss_backpropagates() -> None:
    w = torch.nn.Parameter(torch.tensor(0.3))
    x0 = torch.randn(2, 4, 1, 2, 2, generator=_gen(0))
    loss, _ = flow_matching_loss(
        lambda x, t, e, m: w * x,
        x0,
        torch.zeros(2, 1, 4),
        torch.ones(2, 1, dtype=torch.bool),
        config=FlowMatchingConfig(),
        generator=_gen(1),
    )
    loss.backward()
    assert w.grad is not None and torch.isfinite(w.grad) and w.grad.abs().item() > 0


def test_config_errors_name_every_key() -> None:
    cfg = FlowMatchingConfig(
        shift=0.0,
        timestep_sampling="lognorm",
        weighting="snr",
        logit_std=0.0,
        num_train_timesteps=0,
    )
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert set(err.value.keys) == {
        "objective.shift",
        "objective.timestep_sampling",
        "objective.weighting",
        "objective.logit_std",
        "objective.num_train_timesteps",
    }
    with pytest.raises(ConfigError, match=r"model\.objective\.discrete_timesteps"):
        FlowMatchingConfig(timestep_sampling="logit_normal", discrete_timesteps=True).validate(
            "model.objective"
        )
    FlowMatchingConfig().validate()
