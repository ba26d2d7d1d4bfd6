"""Qwen2.5 dense flavors (tiny for tests; the released 0.5B / 1.5B / 3B tie embeddings, 7B
does not). ``vl_3b`` / ``vl_7b`` are the language models of Qwen2.5-VL-3B / -7B (M-RoPE)."""

from __future__ import annotations

from longboat.core.megatron.models.config import DecoderModelConfig

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

FLAVORS: dict[str, DecoderModelConfig] = {
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
