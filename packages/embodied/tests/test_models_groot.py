"""GR00T N1.6 model: shapes, masking, freezing, per-embodiment weights, overfitting, size."""

from __future__ import annotations

import pytest
import torch

from longboat.embodied.models import apply_freezing, build_model
from longboat.embodied.models.synthetic import synthetic_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return build_model("groot_n1_6", "tiny", overrides=overrides or None)


def _fixed_draw(batch, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    batch["noise"] = torch.randn(batch["action"].shape, generator=g)
    batch["time"] = torch.rand(batch["action"].shape[0], generator=g)
    return batch


def test_forward_shapes_and_finite_loss():
    m = _model()
    batch = synthetic_batch(m, 4)
    out = m(batch)
    assert out["pred_velocity"].shape == (4, 10, 8)
    assert torch.isfinite(out["loss"]) and out["loss"].item() > 0
    m.eval()
    act = m.predict_action(batch, generator=torch.Generator().manual_seed(0))
    assert act.shape == (4, 10, 8) and torch.isfinite(act).all()


def test_image_tokens_placeholder_layout():
    # 56x84 frames -> 4x6 patches -> 2x3 tokens after unshuffle, 2 cameras = 12 per sample.
    m = _model()
    assert m.cfg.tokens_per_image(56, 84) == 6
    batch = _fixed_draw(synthetic_batch(m, 2))
    m.eval()
    auto = m(batch)["loss"]
    # Placeholders already in the text (image_tokens_in_text) equal the prepended ones.
    m2 = _model(image_tokens_in_text=True)
    m2.eval()
    ph = torch.full((2, 12), m.cfg.image_token_id)
    ones = torch.ones(2, 12, dtype=torch.long)
    explicit = dict(
        batch,
        input_ids=torch.cat([ph, batch["input_ids"]], 1),
        attention_mask=torch.cat([ones, batch["attention_mask"]], 1),
    )
    torch.testing.assert_close(m2(explicit)["loss"], auto, rtol=0, atol=0)
    with pytest.raises(ValueError, match="image tokens"):
        m2(batch)  # no placeholders although the config says they are in the text
    with pytest.raises(ValueError, match="image tokens"):
        m(explicit)  # placeholders in the text although the model prepends them


def test_loss_ignores_padded_action_and_state_entries():
    m = _model()
    m.eval()  # no dropout; noise and time fixed through the batch
    batch = _fixed_draw(synthetic_batch(m, 4, action_dim=5, state_dim=6, horizon=8))
    base = m(batch)["loss"]
    g = torch.Generator().manual_seed(9)
    junk = dict(batch)
    pad_a = ~batch["action_mask"]
    junk["action"] = torch.where(pad_a, 100 * torch.randn(4, 10, 8, generator=g), batch["action"])
    junk["state"] = torch.where(~batch["state_mask"], 50.0, batch["state"])
    torch.testing.assert_close(m(junk)["loss"], base, rtol=0, atol=0)
    # ...while a change to a real entry does move it (the test can fail).
    real = dict(batch, action=batch["action"].clone())
    real["action"][0, 0, 0] += 1.0
    assert (m(real)["loss"] - base).abs() > 1e-4


def test_padded_text_tokens_do_not_matter():
    m = _model()
    m.eval()
    batch = _fixed_draw(synthetic_batch(m, 2))
    base = m(batch)["loss"]
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][1, -2:] = 3  # row 1 is right-padded over its last 2 tokens
    torch.testing.assert_close(m(changed)["loss"], base, rtol=0, atol=1e-6)


def test_gradients_reach_exactly_the_trainable_parameters():
    m = _model()
    apply_freezing(m)  # tiny: ViT + projector + embeddings + LM layers 0-1 frozen
    m(synthetic_batch(m, 4))["loss"].backward()
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == torch.float32, name
        else:
            assert p.grad is None and p.dtype == torch.bfloat16, name
    top = m.backbone.llm.layers[-1].mlp.down_proj.weight
    assert top.requires_grad and top.grad.abs().sum() > 0


def test_per_embodiment_layers_pick_the_right_weights():
    # The mixed batch must equal running every sample alone (a per-sample loop reference).
    m = _model()
    m.eval()
    batch = _fixed_draw(synthetic_batch(m, 4))
    batch["embodiment_id"] = torch.tensor([3, 0, 3, 1])
    pred = m(batch)["pred_velocity"]
    for i in range(4):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        torch.testing.assert_close(m(one)["pred_velocity"][0], pred[i], atol=2e-5, rtol=1e-4)
    # ...and the weights do differ per embodiment.
    other = dict(batch, embodiment_id=torch.tensor([2, 0, 3, 1]))
    assert (m(other)["pred_velocity"][0] - pred[0]).abs().max() > 1e-3


def test_grouped_category_impl_equals_bmm():
    a, b = _model(seed=1), _model(seed=1, category_impl="grouped")
    a.eval(), b.eval()
    batch = _fixed_draw(synthetic_batch(a, 4))
    torch.testing.assert_close(a(batch)["loss"], b(batch)["loss"], atol=1e-6, rtol=1e-6)


def test_predict_action_is_euler_over_the_learned_velocity():
    m = _model()
    m.eval()
    batch = synthetic_batch(m, 2)
    noise = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(0))
    one = m.predict_action(batch, noise=noise, num_steps=1)
    v0 = m(
        dict(
            batch,
            action=torch.zeros(2, 10, 8),
            action_mask=torch.zeros(2, 10, 8),
            noise=noise,
            time=torch.zeros(2),
        )
    )["pred_velocity"]
    torch.testing.assert_close(one, noise + v0, atol=1e-5, rtol=1e-5)
    four = m.predict_action(batch, noise=noise)
    assert not torch.allclose(four, one)


def test_tiny_overfits_a_fixed_batch():
    # 100 AdamW steps on one fixed batch (fixed noise/time): loss must fall below 0.05x.
    m = _model()
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


def test_bad_batches_fail_with_the_key_named():
    m = _model()
    batch = synthetic_batch(m, 2)
    with pytest.raises(KeyError, match="embodiment_id"):
        m({k: v for k, v in batch.items() if k != "embodiment_id"})
    with pytest.raises(ValueError, match="max_state_dim"):
        m(dict(batch, state=torch.zeros(2, 5)))
    with pytest.raises(ValueError, match="embodiment_id"):
        m(dict(batch, embodiment_id=torch.tensor([0, 7])))


def test_full_flavor_parameter_count_on_meta():
    m = build_model("groot_n1_6", "full", device="meta")
    n = sum(p.numel() for p in m.parameters())
    assert abs(n - 2.9e9) / 2.9e9 < 0.03, n
    assert len(m.backbone.llm.layers) == 16  # select_layer: layers 16..27 never built
    assert len(m.action_head.model.blocks) == 32
    kinds = [m.action_head.model.block_kind(i) for i in range(4)]
    assert kinds == ["text", "self", "image", "self"]
    assert all(p.is_meta for p in m.parameters())


def test_state_dropout_replaces_the_state_token_in_training_only():
    m = _model(state_dropout_prob=1.0)
    batch = _fixed_draw(synthetic_batch(m, 2))
    other = dict(batch, state=batch["state"] + 0.5 * batch["state_mask"])
    # Same generator for both: the training crop is random too.
    a = m(other, generator=torch.Generator().manual_seed(0))["loss"]
    b = m(batch, generator=torch.Generator().manual_seed(0))["loss"]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    m.eval()
    assert (m(other)["loss"] - m(batch)["loss"]).abs() > 1e-6
