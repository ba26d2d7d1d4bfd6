"""The llm layer spec plugs longboat-kernels into megatron; TE is chosen only where it runs."""

from __future__ import annotations

import dataclasses

import pytest

from longboat.core.family import find_family
from longboat.core.megatron import specs
from longboat.kernels.layers import longboat_layer_kernels


def test_auto_backend_picks_te_only_on_cuda_with_te(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(specs, "transformer_engine_available", lambda: False)
    assert specs.resolve_backend("auto", "cuda") == "longboat"
    with pytest.raises(ValueError, match="transformer_engine is not installed"):
        specs.resolve_backend("te", "cuda")
    monkeypatch.setattr(specs, "transformer_engine_available", lambda: True)
    assert specs.resolve_backend("auto", "cuda") == "te"
    assert specs.resolve_backend("auto", "cpu") == "longboat"
    with pytest.raises(ValueError, match=r"model\.layer_backend='fast'"):
        specs.resolve_backend("fast", "cpu")


def test_longboat_spec_uses_the_kernels() -> None:
    kernels = longboat_layer_kernels()
    cfg = find_family("llm", "qwen3_moe").flavor("tiny")
    spec = find_family("llm", "qwen3_moe").layer_spec(cfg, "longboat", kernels)
    sub = spec.submodules
    attn = sub.self_attention.submodules
    assert attn.core_attention.module is specs.KernelCoreAttention
    assert attn.core_attention.params["attention_fn"] is kernels.attention
    for norm in (sub.input_layernorm, sub.pre_mlp_layernorm, attn.q_layernorm, attn.k_layernorm):
        assert norm.module is specs.KernelRMSNorm
        assert norm.params["rms_norm"] is kernels.rms_norm
    # The default (grouped) experts run the SwiGLU kernel on their packed fc1 output.
    from longboat.core.megatron.grouped_experts import GroupedExperts, GroupedMoELayer

    assert sub.mlp.func is GroupedMoELayer
    experts = sub.mlp.keywords["submodules"].experts
    assert experts.func is GroupedExperts and experts.keywords["glu"] is kernels.swiglu
    # megatron's per-expert loop gets the same kernel as its activation module.
    seq_cfg = dataclasses.replace(cfg, moe_experts="sequential")
    seq = find_family("llm", "qwen3_moe").layer_spec(seq_cfg, "longboat", kernels).submodules.mlp
    seq_experts = seq.keywords["submodules"].experts.keywords["submodules"]
    assert seq_experts.activation_func.module is specs.KernelGLU
    assert seq_experts.activation_func.params["glu"] is kernels.swiglu


def test_dense_spec_without_qk_norm_has_identity() -> None:
    from megatron.core.transformer.identity_op import IdentityOp

    cfg = find_family("llm", "llama3").flavor("tiny")
    spec = find_family("llm", "llama3").layer_spec(cfg, "longboat", longboat_layer_kernels())
    assert spec.submodules.self_attention.submodules.q_layernorm is IdentityOp
