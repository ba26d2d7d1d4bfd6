"""Shared embodied-model blocks: preprocessing, per-embodiment layers, flow matching, masks,
registry, freezing, LoRA."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from longboat.embodied.models import (
    apply_freezing,
    build_model,
    get_config,
    init_weights,
    registered_models,
)
from longboat.embodied.models.common.category_specific import category_linear
from longboat.embodied.models.common.flow_matching import (
    euler_integrate,
    groot_time,
    masked_mse,
    pi0_time,
    sample_beta_a1,
)
from longboat.embodied.models.common.image_preprocessing import (
    ImagePreprocessConfig,
    preprocess_images,
    resize_with_pad,
)
from longboat.embodied.models.pi05.joint import joint_positions, prefix_lm_mask
from longboat.embodied.models.pi05.model import discretize_state

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- image preprocessing ----------------------------------------------------------------


def test_preprocess_shapes_follow_the_reference_sizes():
    cfg = ImagePreprocessConfig(resize_shortest=256, crop_fraction=0.95, multiple_of=28)
    imgs = torch.randint(0, 256, (2, 3, 3, 240, 320), dtype=torch.uint8)
    out = preprocess_images(imgs, cfg, train=True, generator=torch.Generator().manual_seed(0))
    # 240x320 -> 256x341 -> floor to multiples of 28 -> 252x336 (18x24 patches of 14).
    assert out.shape == (2, 3, 3, 252, 336)
    assert out.dtype == torch.float32
    assert cfg.output_size(256, 256) == (252, 252)


def test_preprocess_is_deterministic_given_a_generator():
    cfg = ImagePreprocessConfig(resize_shortest=56, crop_fraction=0.9, multiple_of=28)
    imgs = torch.rand(4, 3, 56, 84)
    a = preprocess_images(imgs, cfg, train=True, generator=torch.Generator().manual_seed(1))
    b = preprocess_images(imgs, cfg, train=True, generator=torch.Generator().manual_seed(1))
    c = preprocess_images(imgs, cfg, train=True, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - c).abs().max() > 1e-3
    # uint8 input equals the same frames as floats in [0, 1].
    u8 = (imgs * 255).round().to(torch.uint8)
    torch.testing.assert_close(
        preprocess_images(u8, cfg, train=False),
        preprocess_images(u8.float() / 255, cfg, train=False),
    )


def test_resize_with_pad_keeps_aspect_and_pads_black():
    # openpi's resize_with_pad: 112x224 -> 112x224 inside a 224x224 frame, 56 rows of black
    # above and below (-1 after SigLIP normalisation); every camera gives 16x16 patches.
    cfg = ImagePreprocessConfig(pad_to_square=224, crop_fraction=1.0, multiple_of=14)
    img = torch.full((1, 3, 112, 224), 255, dtype=torch.uint8)
    out = preprocess_images(img, cfg, train=False)
    assert out.shape == (1, 3, 224, 224) and cfg.output_size(480, 640) == (224, 224)
    assert torch.all(out[..., :56, :] == -1) and torch.all(out[..., 168:, :] == -1)
    torch.testing.assert_close(out[..., 56:168, :], torch.ones(1, 3, 112, 224))


def test_resize_with_pad_samples_as_lerobots_pi05():
    # LeRobot's pi0.5 (openpi's resize_with_pad_torch) resizes with plain bilinear at
    # half-pixel centres: halving a side reads the mean of each 2x2 block, where an
    # antialiased resize would blur over 4x4. Sizes are floored from dim / ratio.
    x = torch.rand(2, 3, 224, 448, generator=torch.Generator().manual_seed(0))
    out = resize_with_pad(x, 224)
    assert out[..., :56, :].abs().max() == 0 and out[..., 168:, :].abs().max() == 0
    torch.testing.assert_close(out[..., 56:168, :], F.avg_pool2d(x, 2), rtol=0, atol=1e-6)
    # 299x224 -> 224x167.8: 167 columns (not 168), padded 28 left and 29 right.
    tall = resize_with_pad(torch.ones(1, 3, 299, 224), 224)
    cols = tall[0, 0].amax(dim=0)
    assert int(cols.sum()) == 167 and cols[:28].max() == 0 and cols[-29:].max() == 0
    # 288x288: 288 / (288 / 224) is 223.99999999999997 in floats, so 223 rows and columns,
    # the missing one black at the bottom and right.
    square = resize_with_pad(torch.ones(1, 3, 288, 288), 224)[0, 0]
    assert int(square.sum()) == 223 * 223 and square[-1].max() == 0 and square[:, -1].max() == 0
    # Enlarging needs no antialiasing either way; frames already at the size pass unchanged.
    small = torch.rand(1, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        resize_with_pad(small, 56),
        F.interpolate(small, size=(56, 56), mode="bilinear", align_corners=False).clamp(0, 1),
    )
    assert torch.equal(resize_with_pad(small, 48), small)


def test_crop_geometry_on_a_linear_ramp():
    # Bilinear resampling reproduces a linear image exactly, so the output ramp reveals the
    # crop: centre crop of fraction f maps output coordinate x to f * x; random crops shift it
    # by at most (1 - f).
    f, w = 0.8, 40
    cfg = ImagePreprocessConfig(
        resize_shortest=None, crop_fraction=f, multiple_of=4, mean=(0, 0, 0), std=(1, 1, 1)
    )
    x = (2 * torch.arange(w) + 1) / w - 1  # pixel-centre coordinates in (-1, 1)
    ramp = x.expand(2, 3, w, w).contiguous()
    out = preprocess_images(ramp, cfg, train=False)
    torch.testing.assert_close(out, f * ramp, atol=1e-5, rtol=0)
    rnd = preprocess_images(ramp, cfg, train=True, generator=torch.Generator().manual_seed(0))
    shift = rnd - f * ramp
    assert shift.std(dim=(1, 2, 3)).max() < 1e-5  # a pure translation per image
    assert shift.abs().max() <= (1 - f) + 1e-5


# ---- per-embodiment layers --------------------------------------------------------------


@pytest.mark.parametrize("impl", ["bmm", "grouped"])
def test_category_linear_matches_a_per_sample_loop(impl):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 6, 7, generator=g, requires_grad=True)
    bias = torch.randn(5, 7, generator=g, requires_grad=True)
    x = torch.randn(6, 3, 6, generator=g, requires_grad=True)
    ids = torch.tensor([4, 0, 4, 2, 0, 1])
    out = category_linear(x, w, bias, ids, impl)
    ref = torch.stack([x[i] @ w[ids[i]] + bias[ids[i]] for i in range(6)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (x, w, bias))
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, w, bias))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    assert grads[1][3].abs().max() == 0  # embodiment 3 is absent: no gradient


# ---- flow matching ----------------------------------------------------------------------


def test_beta_sampler_matches_beta_moments_and_conventions():
    dev = torch.device("cpu")
    s = sample_beta_a1(1.5, 200_000, device=dev, generator=torch.Generator().manual_seed(0))
    # Beta(1.5, 1): mean a/(a+1) = 0.6, var a/((a+1)^2 (a+2)) = 0.06857
    assert abs(s.mean().item() - 0.6) < 3e-3
    assert abs(s.var().item() - 1.5 / (2.5**2 * 3.5)) < 2e-3
    tg = groot_time(10_000, device=dev, generator=torch.Generator().manual_seed(1))
    assert tg.min() >= 0 and tg.max() <= 0.999 and abs(tg.mean().item() - 0.999 * 0.4) < 0.01
    tp = pi0_time(10_000, device=dev, generator=torch.Generator().manual_seed(1))
    assert (
        tp.min() >= 0.001 and tp.max() <= 1.0 and abs(tp.mean().item() - 0.6 * 0.999 - 0.001) < 0.01
    )


def test_masked_mse_and_euler():
    pred, tgt = torch.zeros(2, 3), torch.tensor([[1.0, 2.0, 100.0], [3.0, 0.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert masked_mse(pred, tgt, mask).item() == pytest.approx((1 + 4 + 9 + 0) / 4)
    # dx/dt = t integrated 0 -> 1 with 4 Euler steps: sum_k k/4 * 1/4 = 6/16.
    x = euler_integrate(lambda x, t: torch.full_like(x, t), torch.zeros(1), 0.0, 1.0, 4)
    assert x.item() == pytest.approx(6 / 16)
    # pi0 direction: t from 1 to 0 with 10 steps, dt = -0.1: sum of -0.1 * t_k, t_k = 1 .. 0.1
    x = euler_integrate(lambda x, t: torch.full_like(x, t), torch.zeros(1), 1.0, 0.0, 10)
    assert x.item() == pytest.approx(-0.1 * sum(1 - k / 10 for k in range(10)))


# ---- pi0.5 masks and state tokens -------------------------------------------------------


def test_prefix_lm_mask_semantics():
    valid = torch.tensor([[True, True, False]])
    m = prefix_lm_mask(valid, 2)[0, 0]
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0],  # prefix: bidirectional over valid prefix, never the suffix
            [1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],  # padded prefix row: output never read, kept NaN-free
            [1, 1, 0, 1, 1],  # suffix: valid prefix + all of the suffix
            [1, 1, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, expected)
    pos_p, pos_s = joint_positions(valid, 2)
    assert pos_p.tolist() == [[0, 1, 1]] and pos_s.tolist() == [[2, 3]]


def test_discretize_state_matches_numpy_digitize():
    state = torch.tensor([[-1.0, -0.9999, 0.0, 0.5, 0.99999, -0.3]])
    ref = np.digitize(state.numpy(), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
    assert discretize_state(state, 256).tolist() == ref.tolist()
    assert discretize_state(torch.tensor([[-5.0, 5.0]]), 256).tolist() == [[0, 255]]


# ---- registry and freezing --------------------------------------------------------------


def test_registry_builds_by_name_and_rejects_unknown_keys():
    assert {"groot_n1_6", "pi05"} <= set(registered_models())
    cfg = get_config("groot_n1_6", "tiny", {"dit.dropout": 0.1, "action_horizon": 12})
    assert cfg.dit.dropout == 0.1 and cfg.action_horizon == 12
    with pytest.raises(KeyError, match="not a flavor"):
        get_config("groot_n1_6", "huge")
    with pytest.raises(KeyError, match="not registered"):
        build_model("nope", "tiny")
    with pytest.raises(KeyError, match=r"dit\.bogus"):
        get_config("groot_n1_6", "tiny", {"dit.bogus": 1})
    with pytest.raises(ValueError, match="tune_top_llm_layers"):
        get_config("groot_n1_6", "tiny", {"tune_top_llm_layers": 9})
    # Interdependent keys change together and are validated once, in any order.
    small = {
        "image_token_id": 4000,
        "llm.vocab_size": 4096,
        "llm.num_layers": 2,
        "select_layer": 2,
        "tune_top_llm_layers": 1,
    }
    cfg = get_config("groot_n1_6", "full", small)
    assert (cfg.llm.vocab_size, cfg.image_token_id, cfg.llm.hidden_size) == (4096, 4000, 2048)


def test_apply_freezing_sets_flags_and_dtypes():
    m = build_model("groot_n1_6", "tiny")
    counts = apply_freezing(m)
    layers = m.backbone.llm.layers
    assert len(layers) == 3  # select_layer=3: layer 3 is never built
    assert all(
        not p.requires_grad and p.dtype == torch.bfloat16 for p in m.backbone.vision.parameters()
    )
    assert all(not p.requires_grad for p in layers[1].parameters())
    assert all(p.requires_grad and p.dtype == torch.float32 for p in layers[2].parameters())
    assert all(p.requires_grad for p in m.action_head.parameters())
    total = sum(p.numel() for p in m.parameters())
    assert counts["trainable"] + counts["frozen"] == total
    assert counts["trainable"] == sum(p.numel() for p in m.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["groot_n1_6", "pi05", "smolvla"])
def test_meta_build_then_init_weights_gives_a_working_model(name):
    # The FSDP path: build on meta, materialise with to_empty, initialise in place.
    from longboat.embodied.models.synthetic import synthetic_batch

    m = build_model(name, "tiny", device="meta").to_empty(device="cpu")
    torch.manual_seed(0)
    init_weights(m)
    assert all(torch.isfinite(p).all() for p in m.parameters())
    # Norm scales and zero-init modulations come back exactly (no leftover garbage).
    for mod in m.modules():
        if type(mod).__name__ == "AdaRMSNorm":
            assert mod.modulation.weight.abs().max() == 0
        if type(mod).__name__ == "RMSNorm":
            assert torch.all(mod.weight == (0.0 if mod.offset else 1.0))
    # Same seed, same weights as another initialisation.
    ref = build_model(name, "tiny", device="meta").to_empty(device="cpu")
    torch.manual_seed(0)
    init_weights(ref)
    for (n, a), b in zip(m.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    loss = m(synthetic_batch(m, 2))["loss"]
    assert torch.isfinite(loss) and 0.5 < loss.item() < 10


def test_lora_trains_only_adapters():
    from longboat.embodied.models.synthetic import synthetic_batch
    from longboat.embodied.train.lora import apply_lora

    m = build_model("groot_n1_6", "tiny")
    apply_lora(m, ["q_proj", "k_proj", "v_proj", "o_proj"], rank=4, alpha=8, dropout=0.0)
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    m(synthetic_batch(m, 2))["loss"].backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


def test_sinusoid_sanity():
    # guard against silently changing the GR00T timestep embedding convention
    from longboat.embodied.models.common.layers import sinusoidal_embedding

    e = sinusoidal_embedding(
        torch.tensor([0.0, 10.0]), 8, flip_sin_to_cos=True, downscale_freq_shift=1
    )
    assert e[0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    freq0 = math.exp(0)
    assert e[1, 0].item() == pytest.approx(math.cos(10 * freq0), abs=1e-5)


def test_vit_residual_stream_is_token_major_in_every_block():
    """The patch embedding's channel-major output is made token-major before the position
    add: otherwise the sum keeps its strides and every residual add and norm of the ViT runs
    strided (on an H200, two strided copies and two strided adds a layer)."""
    from longboat.embodied.models.common.vit import VisionTransformer
    from longboat.embodied.models.init_from import resolve_model_config

    torch.manual_seed(0)
    vit = VisionTransformer(resolve_model_config("groot_n1_6", "tiny", {}, None).vision)
    layouts: list[bool] = []
    for block in vit.blocks:
        block.register_forward_pre_hook(lambda mod, args: layouts.append(args[0].is_contiguous()))
    tokens, grid = vit(torch.randn(2, 3, 56, 84))
    assert grid == (4, 6) and tokens.shape == (2, 24, vit.cfg.hidden_size)
    assert layouts == [True] * len(vit.blocks)
