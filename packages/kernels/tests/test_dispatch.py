"""Implementation choice: argument > env > auto; clear errors for impossible choices."""

from __future__ import annotations

import pytest
import torch

from longboat import kernels as K
from longboat.kernels._dispatch import resolve_impl, triton_interpreter_on


def test_auto_picks_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LONGBOAT_KERNELS_IMPL", raising=False)
    assert resolve_impl(None, torch.zeros(2)) == "torch"
    x, w = torch.randn(3, 10), torch.randn(10)
    torch.testing.assert_close(K.rms_norm(x, w), K.rms_norm_torch(x, w), rtol=0, atol=0)


def test_env_and_argument_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONGBOAT_KERNELS_IMPL", "torch")
    assert resolve_impl(None, torch.zeros(1)) == "torch"
    monkeypatch.setenv("LONGBOAT_KERNELS_IMPL", "bogus")
    with pytest.raises(ValueError, match="LONGBOAT_KERNELS_IMPL env='bogus'"):
        resolve_impl(None, torch.zeros(1))
    assert resolve_impl("torch", torch.zeros(1)) == "torch"  # argument wins over env


@pytest.mark.skipif(triton_interpreter_on(), reason="interpreter makes triton valid on CPU")
def test_forced_triton_on_cpu_explains_fix() -> None:
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        K.rms_norm(torch.randn(2, 8), torch.ones(8), impl="triton")


def test_bad_shapes_raise_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="weight shape"):
        K.rms_norm(torch.randn(2, 8), torch.ones(7))
    with pytest.raises(ValueError, match="scale shape"):
        K.ada_layer_norm(torch.randn(2, 3, 8), torch.ones(3, 8), torch.ones(2, 8))
    with pytest.raises(ValueError, match="even last dim"):
        K.swiglu(torch.randn(2, 7))
    with pytest.raises(ValueError, match="target shape"):
        K.fused_linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(3))


def test_references_match_textbook_formulas() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    r = torch.randn(4, 6, dtype=torch.float64)
    y, h = K.rms_norm_torch(x, w, 1e-6, r)
    hh = x + r
    torch.testing.assert_close(h, hh)
    torch.testing.assert_close(y, hh / (hh.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w)
    g, u = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(K.swiglu(g, u), g * torch.sigmoid(g) * u)
    torch.testing.assert_close(K.swiglu(torch.cat([g, u], -1)), g * torch.sigmoid(g) * u)
    # RoPE at position p rotates each (x_i, x_{i+half}) pair by p * inv_freq_i.
    cos, sin = K.rope_cos_sin(8, 4, base=10000.0, dtype=torch.float64)
    q = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    qo, _ = K.apply_rope_torch(q, q, cos, sin, torch.tensor([[3]]))
    ang = 3 * torch.tensor([1.0, 10000.0 ** (-0.5)], dtype=torch.float64)
    x1, x2 = q[0, 0, 0, :2], q[0, 0, 0, 2:]
    expect = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()])
    torch.testing.assert_close(qo[0, 0, 0], expect)
    # Fused CE reference equals log-softmax NLL plus z-loss on the kept tokens.
    hid, wt = torch.randn(5, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    t = torch.tensor([1, -100, 6, 0, 2])
    logits = hid @ wt.t()
    lse = logits.logsumexp(-1)
    keep = t != -100
    per = lse - logits.gather(1, t.clamp(min=0)[:, None])[:, 0] + 1e-2 * lse**2
    got = K.fused_linear_cross_entropy(hid, wt, t, z_loss=1e-2)
    torch.testing.assert_close(got, per[keep].mean().float())


def test_auto_policy_under_compile() -> None:
    from longboat.kernels._dispatch import auto_choice

    kw = dict(on_gpu=True, triton_usable=True)
    assert auto_choice(**kw, compiling=False, compiled_reference_wins=True) == "triton"
    assert auto_choice(**kw, compiling=True, compiled_reference_wins=True) == "torch"
    assert auto_choice(**kw, compiling=True, compiled_reference_wins=False) == "triton"
    assert (
        auto_choice(
            on_gpu=False, triton_usable=True, compiling=False, compiled_reference_wins=False
        )
        == "torch"
    )
