"""longboat's fused QKV RoPE against megatron's own split + rotation, and its install."""

from __future__ import annotations

import torch

from longboat.core.megatron.qkv_rope import (
    fused_qkv_rope,
    fused_qkv_rope_applies,
    install_fused_qkv_rope,
)


def _freqs(seq: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    theta = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat([theta, theta], -1)[:, None, None, :]  # megatron's [s, 1, 1, d]


def _megatron_reference(mixed, freqs, split):  # type: ignore[no-untyped-def]
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    q, k, v = torch.split(mixed, split, dim=3)
    q = q.reshape(q.size(0), q.size(1), -1, split[1])
    return _apply_rotary_pos_emb_bshd(q, freqs), _apply_rotary_pos_emb_bshd(k, freqs), v


def test_matches_megatron_split_and_rotation_forward_and_backward() -> None:
    torch.manual_seed(0)
    s, b, groups, qpg, hn = 7, 3, 2, 4, 16
    split = [qpg * hn, hn, hn]
    freqs = _freqs(s, hn)
    mixed = torch.randn(s, b, groups, (qpg + 2) * hn, dtype=torch.float64, requires_grad=True)
    ref_mixed = mixed.detach().clone().requires_grad_()
    got = fused_qkv_rope(mixed, freqs, freqs, split)
    ref = _megatron_reference(ref_mixed, freqs.double(), split)
    for g, r, name in zip(got, ref, "qkv"):
        assert g.shape == r.shape, name
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6, msg=name)
    w = [torch.randn_like(r) for r in ref]
    sum((g * x).sum() for g, x in zip(got, w)).backward()
    sum((r * x).sum() for r, x in zip(ref, w)).backward()
    torch.testing.assert_close(mixed.grad, ref_mixed.grad, rtol=1e-6, atol=1e-6)


def test_different_q_and_k_embeddings_fall_back_to_megatron() -> None:
    torch.manual_seed(1)
    s, b, hn = 5, 2, 8
    split = [2 * hn, hn, hn]
    fq, fk = _freqs(s, hn), _freqs(s, hn) * 0.5
    mixed = torch.randn(s, b, 1, 4 * hn)
    got = fused_qkv_rope(mixed, fq, fk, split)
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    q, k, _ = torch.split(mixed, split, dim=3)
    torch.testing.assert_close(got[1], _apply_rotary_pos_emb_bshd(k, fk))
    torch.testing.assert_close(got[0], _apply_rotary_pos_emb_bshd(q.reshape(s, b, 2, hn), fq))


def test_install_gives_megatron_the_function() -> None:
    from megatron.core.transformer import attention

    missing = object()
    before = (
        getattr(attention, "apply_fused_qkv_rotary_pos_emb", missing),
        attention.HAVE_FUSED_QKV_ROPE,
    )
    try:
        install_fused_qkv_rope()
        assert attention.apply_fused_qkv_rotary_pos_emb is fused_qkv_rope
        assert attention.HAVE_FUSED_QKV_ROPE is True
    finally:  # other tests must see megatron as it was (without TE: no such function)
        if before[0] is missing:
            del attention.apply_fused_qkv_rotary_pos_emb
        else:
            attention.apply_fused_qkv_rotary_pos_emb = before[0]
        attention.HAVE_FUSED_QKV_ROPE = before[1]


def test_applies_only_where_megatron_can_use_it() -> None:
    ok = dict(qk_layernorm=False, packed_sequences=False, rotary_interleaved=False, position="rope")
    assert fused_qkv_rope_applies(**ok)
    for key, bad in (("qk_layernorm", True), ("packed_sequences", True), ("position", "none")):
        assert not fused_qkv_rope_applies(**{**ok, key: bad})
