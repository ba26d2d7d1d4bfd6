"""The released shapes of the decoders longboat builds (core ``DecoderModelConfig``), by
decoder name (``llama3``, ``qwen2``, ``qwen3``, ``qwen3_moe``) and flavor (``tiny`` for tests;
``qwen2`` ``vl_3b`` / ``vl_7b`` are the M-RoPE language models of Qwen2.5-VL-3B / -7B). The
llm stack's families train them and the vlm stack composes them as language models; their HF
config dialects are in ``longboat.core.megatron.hf_decoder_config``."""

from __future__ import annotations

import dataclasses

from longboat.core.config.errors import ConfigError
from longboat.core.config.suggest import did_you_mean
from longboat.core.megatron.decoder_config import DecoderModelConfig

_LLAMA3 = dict(name="llama3", norm_eps=1e-5, rope_theta=500000.0)

_LLAMA3_FLAVORS: dict[str, DecoderModelConfig] = {
    "tiny": DecoderModelConfig(
        flavor="tiny",
        vocab_size=256,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=128,
        max_position_embeddings=256,
        **_LLAMA3,
    ),
    "1b": DecoderModelConfig(
        flavor="1b",
        vocab_size=128256,
        hidden_size=2048,
        num_layers=16,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=64,
        ffn_hidden_size=8192,
        max_position_embeddings=131072,
        rope_scaling_factor=32.0,
        tie_embeddings=True,
        **_LLAMA3,
    ),
    "8b": DecoderModelConfig(
        flavor="8b",
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=14336,
        max_position_embeddings=131072,
        rope_scaling_factor=8.0,
        **_LLAMA3,
    ),
    "70b": DecoderModelConfig(
        flavor="70b",
        vocab_size=128256,
        hidden_size=8192,
        num_layers=80,
        num_attention_heads=64,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=28672,
        max_position_embeddings=131072,
        rope_scaling_factor=8.0,
        **_LLAMA3,
    ),
}

_QWEN2 = dict(
    name="qwen2",
    qk_norm=False,
    attention_bias=True,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=32768,
)

_QWEN2_FLAVORS: dict[str, DecoderModelConfig] = {
    "tiny": DecoderModelConfig(
        **{**_QWEN2, "vocab_size": 256, "head_dim": 16, "max_position_embeddings": 256},
        flavor="tiny",
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        tie_embeddings=True,
    ),
    "0.5b": DecoderModelConfig(
        **{**_QWEN2, "head_dim": 64},
        flavor="0.5b",
        hidden_size=896,
        num_layers=24,
        num_attention_heads=14,
        num_query_groups=2,
        ffn_hidden_size=4864,
        tie_embeddings=True,
    ),
    "1.5b": DecoderModelConfig(
        **_QWEN2,
        flavor="1.5b",
        hidden_size=1536,
        num_layers=28,
        num_attention_heads=12,
        num_query_groups=2,
        ffn_hidden_size=8960,
        tie_embeddings=True,
    ),
    "3b": DecoderModelConfig(
        **_QWEN2,
        flavor="3b",
        hidden_size=2048,
        num_layers=36,
        num_attention_heads=16,
        num_query_groups=2,
        ffn_hidden_size=11008,
        tie_embeddings=True,
    ),
    "7b": DecoderModelConfig(
        **{**_QWEN2, "vocab_size": 152064},
        flavor="7b",
        hidden_size=3584,
        num_layers=28,
        num_attention_heads=28,
        num_query_groups=4,
        ffn_hidden_size=18944,
        tie_embeddings=False,
    ),
    "vl_3b": DecoderModelConfig(
        **{**_QWEN2, "max_position_embeddings": 128000},
        flavor="vl_3b",
        hidden_size=2048,
        num_layers=36,
        num_attention_heads=16,
        num_query_groups=2,
        ffn_hidden_size=11008,
        tie_embeddings=True,
        mrope_section=[16, 24, 24],
    ),
    "vl_7b": DecoderModelConfig(
        **{**_QWEN2, "vocab_size": 152064, "max_position_embeddings": 128000},
        flavor="vl_7b",
        hidden_size=3584,
        num_layers=28,
        num_attention_heads=28,
        num_query_groups=4,
        ffn_hidden_size=18944,
        tie_embeddings=False,
        mrope_section=[16, 24, 24],
    ),
}

_QWEN3 = dict(
    name="qwen3",
    qk_norm=True,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
)

_QWEN3_FLAVORS: dict[str, DecoderModelConfig] = {
    "tiny": DecoderModelConfig(
        **{**_QWEN3, "vocab_size": 256, "head_dim": 16, "max_position_embeddings": 256},
        flavor="tiny",
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        tie_embeddings=True,
    ),
    "0.6b": DecoderModelConfig(
        **_QWEN3,
        flavor="0.6b",
        hidden_size=1024,
        num_layers=28,
        num_attention_heads=16,
        num_query_groups=8,
        ffn_hidden_size=3072,
        tie_embeddings=True,
    ),
    "1.7b": DecoderModelConfig(
        **_QWEN3,
        flavor="1.7b",
        hidden_size=2048,
        num_layers=28,
        num_attention_heads=16,
        num_query_groups=8,
        ffn_hidden_size=6144,
        tie_embeddings=True,
    ),
    "8b": DecoderModelConfig(
        **_QWEN3,
        flavor="8b",
        hidden_size=4096,
        num_layers=36,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=12288,
        tie_embeddings=False,
    ),
    "32b": DecoderModelConfig(
        **_QWEN3,
        flavor="32b",
        hidden_size=5120,
        num_layers=64,
        num_attention_heads=64,
        num_query_groups=8,
        ffn_hidden_size=25600,
        tie_embeddings=False,
    ),
}

_QWEN3_MOE_FLAVORS: dict[str, DecoderModelConfig] = {
    "tiny": DecoderModelConfig(
        name="qwen3_moe",
        flavor="tiny",
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=128,
        max_position_embeddings=256,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
        num_experts=4,
        moe_topk=2,
        moe_ffn_hidden_size=32,
        moe_norm_topk_prob=True,
        moe_aux_loss_coeff=0.0,
    ),
    "30b_a3b": DecoderModelConfig(
        name="qwen3_moe",
        flavor="30b_a3b",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=6144,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
        num_experts=128,
        moe_topk=8,
        moe_ffn_hidden_size=768,
        moe_norm_topk_prob=True,
        moe_aux_loss_coeff=0.001,
    ),
}


DECODER_FLAVORS: dict[str, dict[str, DecoderModelConfig]] = {
    "llama3": _LLAMA3_FLAVORS,
    "qwen2": _QWEN2_FLAVORS,
    "qwen3": _QWEN3_FLAVORS,
    "qwen3_moe": _QWEN3_MOE_FLAVORS,
}
"""Decoder flavors by decoder name, then flavor name."""


def decoder_names() -> list[str]:
    """The decoder names with flavors here."""
    return sorted(DECODER_FLAVORS)


def decoder_flavor(name: str, flavor: str, *, key: str = "model") -> DecoderModelConfig:
    """A copy of decoder ``name``'s flavor ``flavor``; a ``ConfigError`` naming
    ``<key>.name`` / ``<key>.flavor`` otherwise (``key``: where the config sits, e.g.
    ``model.language`` for a VLM's decoder)."""
    if name not in DECODER_FLAVORS:
        raise ConfigError(
            "unknown decoder",
            key=f"{key}.name",
            value=name,
            fix=did_you_mean(name, decoder_names(), what="decoders"),
        )
    flavors = DECODER_FLAVORS[name]
    if flavor not in flavors:
        raise ConfigError(
            f"decoder {name!r} has flavors {sorted(flavors)}",
            key=f"{key}.flavor",
            value=flavor,
            fix=did_you_mean(flavor, list(flavors), what=f"{name} flavors"),
        )
    return dataclasses.replace(flavors[flavor])


__all__ = ["DECODER_FLAVORS", "decoder_flavor", "decoder_names"]
