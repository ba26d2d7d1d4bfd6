"""Llama 3 flavors (tiny for tests; 1B = Llama 3.2 1B, 8B / 70B = Llama 3.1)."""

from __future__ import annotations

from longboat.core.megatron.decoder_config import DecoderModelConfig

_LLAMA3 = dict(name="llama3", norm_eps=1e-5, rope_theta=500000.0)

FLAVORS: dict[str, DecoderModelConfig] = {
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
