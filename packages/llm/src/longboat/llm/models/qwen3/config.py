"""Qwen3 dense flavors (tiny for tests; the real 0.6B / 1.7B tie embeddings, 8B / 32B do not)."""

from __future__ import annotations

from longboat.core.megatron.decoder_config import DecoderModelConfig

_QWEN3 = dict(
    name="qwen3",
    qk_norm=True,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
)

FLAVORS: dict[str, DecoderModelConfig] = {
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
