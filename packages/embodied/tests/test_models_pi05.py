"""pi0.5 model: shapes, masking, prefix-LM semantics, KV cache, freezing, overfit, size."""

from __future__ import annotations

import pytest
import torch

from longboat.embodied.models import apply_freezing, build_model
from longboat.embodied.models.synthetic import synthetic_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    m = build_model("pi05", "tiny", overrides=overrides or None)
    # Zero-initialised adaRMSNorm gates make the expert an identity at step 0; give them
    # random values so the suffix path is exercised by the equivalence tests.
    with torch.no_grad():
        for layer in (jl.expert for jl in m.joint.layers):
            for norm in (layer.input_norm, layer.post_attention_norm):
                norm.modulation.weight.normal_(0, 0.2)
    return m


def _fixed_draw(batch, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    batch["noise"] = torch.randn(batch["action"].shape, generator=g)
    batch["time"] = torch.rand(batch["action"].shape[0], generator=g)
    return batch


def test_forward_shapes_and_finite_loss():
    m = _model()
    batch = synthetic_batch(m, 3)
    out = m(batch)
    assert out["pred_velocity"].shape == (3, 10, 8)
    assert torch.isfinite(out["loss"]) and out["loss"].item() > 0
    prefix, valid = m.embed_prefix(batch)
    # 3 cameras x 16 tokens + 7 text + 8 state tokens; the masked camera is invalid.
    assert prefix.shape == (3, 48 + 7 + 8, 64)
    assert valid[:, 32:48].sum() == 0


def test_loss_ignores_padding_masked_cameras_and_padded_tokens():
    m = _model()
    m.eval()
    batch = _fixed_draw(synthetic_batch(m, 2, action_dim=5, state_dim=6, horizon=8))
    base = m(batch)["loss"]
    junk = dict(batch)
    g = torch.Generator().manual_seed(3)
    junk["action"] = torch.where(
        batch["action_mask"], batch["action"], 100 * torch.randn(2, 10, 8, generator=g)
    )
    junk["state"] = torch.where(batch["state_mask"], batch["state"], 0.77)
    images = batch["images"].clone()
    images[:, 2] = 255 - images[:, 2]  # camera 2 is masked out
    junk["images"] = images
    ids = batch["input_ids"].clone()
    ids[1, -2:] = 9  # padded text of row 1
    junk["input_ids"] = ids
    torch.testing.assert_close(m(junk)["loss"], base, rtol=0, atol=1e-6)
    # ...while real state values do reach the prediction (the test can fail).
    real = dict(batch, state=-batch["state"])
    diff = m(real)["pred_velocity"] - m(batch)["pred_velocity"]
    assert diff.abs().max() > 1e-4


def test_prefix_never_sees_the_suffix():
    m = _model()
    m.eval()
    batch = synthetic_batch(m, 2)
    prefix, valid = m.embed_prefix(batch)
    outs = []
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        x_t = torch.randn(2, 10, 8, generator=g)
        suffix, cond = m.embed_suffix(x_t, torch.rand(2, generator=g))
        outs.append(m.joint(prefix, valid, suffix, cond, full_prefix=True))
    (p0, s0), (p1, s1) = outs
    torch.testing.assert_close(p0, p1, rtol=0, atol=0)  # suffix changed, prefix did not
    assert (s0 - s1).abs().max() > 1e-3
    # ...and the suffix does read the prefix.
    suffix, cond = m.embed_suffix(torch.zeros(2, 10, 8), torch.full((2,), 0.5))
    _, a = m.joint(prefix, valid, suffix, cond)
    _, b = m.joint(prefix + 0.1, valid, suffix, cond)
    assert (a - b).abs().max() > 1e-4


def test_kv_cache_prediction_equals_uncached():
    m = _model()
    m.eval()
    batch = synthetic_batch(m, 2)
    noise = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(0))
    cached = m.predict_action(batch, noise=noise, use_cache=True)
    plain = m.predict_action(batch, noise=noise, use_cache=False)
    assert cached.shape == (2, 10, 8)
    torch.testing.assert_close(cached, plain, atol=1e-5, rtol=1e-5)
    # 1 step from t=1: x = noise - v(noise, 1), the training model's velocity.
    one = m.predict_action(batch, noise=noise, num_steps=1)
    v = m(
        dict(
            batch,
            action=torch.zeros(2, 10, 8),
            action_mask=torch.zeros(2, 10, 8),
            noise=noise,
            time=torch.ones(2),
        )
    )["pred_velocity"]
    torch.testing.assert_close(one, noise - v, atol=1e-5, rtol=1e-5)


def test_gradients_reach_exactly_the_trainable_parameters():
    m = _model(tune_visual=False, tune_llm=False, tune_top_llm_layers=2)
    apply_freezing(m)
    m(synthetic_batch(m, 2))["loss"].backward()
    unused = {id(p) for p in m.joint.unused_parameters()}
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == torch.float32, name
        else:
            assert p.grad is None and p.dtype == torch.bfloat16, name
    assert not m.joint.layers[1].lm.k_proj.weight.requires_grad
    assert m.joint.layers[2].lm.k_proj.weight.grad.abs().sum() > 0
    last = m.joint.layers[-1].lm
    assert id(last.mlp.down_proj.weight) in unused and not last.mlp.down_proj.weight.requires_grad
    assert last.k_proj.weight.requires_grad  # its K/V still feed the suffix


def test_tiny_overfits_a_fixed_batch():
    # 100 AdamW steps on one fixed batch (fixed noise/time): loss must fall below 0.05x.
    torch.manual_seed(0)
    m = build_model("pi05", "tiny")
    batch = _fixed_draw(synthetic_batch(m, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    losses = []
    for _ in range(100):
        loss = m(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0], losses


def test_predict_action_is_deterministic_given_a_generator():
    m = _model()
    m.eval()
    batch = synthetic_batch(m, 2)
    a = m.predict_action(batch, generator=torch.Generator().manual_seed(4))
    b = m.predict_action(batch, generator=torch.Generator().manual_seed(4))
    c = m.predict_action(batch, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - c).abs().max() > 1e-3


def test_bad_batches_fail_with_the_key_named():
    m = _model()
    batch = synthetic_batch(m, 2)
    with pytest.raises(KeyError, match="images"):
        m({k: v for k, v in batch.items() if k != "images"})
    with pytest.raises(ValueError, match="max_token_len"):
        m(
            dict(
                batch,
                input_ids=torch.zeros(2, 45, dtype=torch.long),
                attention_mask=torch.ones(2, 45),
            )
        )
    with pytest.raises(ValueError, match="action_dim"):
        m(dict(batch, action=torch.zeros(2, 10, 5)))


def test_full_flavor_parameter_count_on_meta():
    m = build_model("pi05", "full", device="meta")
    n = sum(p.numel() for p in m.parameters())
    assert abs(n - 3.3e9) / 3.3e9 < 0.03, n
    expert = sum(p.numel() for jl in m.joint.layers for p in jl.expert.parameters())
    assert 0.25e9 < expert < 0.5e9, expert  # "gemma 300M" with its adaRMSNorm denses
    assert all(p.is_meta for p in m.parameters())
