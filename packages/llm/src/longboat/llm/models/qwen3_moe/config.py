"""Qwen3-MoE flavors (tiny for tests; 30B-A3B as released: 128 experts, top-8, no shared expert)."""

from __future__ import annotations

from longboat.core.megatron.decoder_config import DecoderModelConfig

FLAVORS: dict[str, DecoderModelConfig] = {
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
