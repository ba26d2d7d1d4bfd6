"""What the decoder families share: HF config.json reading (transformers 4.x and 5.x
layouts) and the Llama-style layer spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from longboat.core.megatron.models.config import DecoderModelConfig

if TYPE_CHECKING:
    from longboat.core.megatron.specs import LayerKernels

from longboat.core.config.errors import ConfigError

# megatron-core's Llama-3 rope scaling hard-codes these (RotaryEmbedding._apply_scaling).
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def rope_from_hf(hf: dict[str, Any], source: str = "config.json") -> tuple[float, float | None]:
    """``(rope_theta, llama3 scaling factor or None)`` from an HF config dict."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    params.update(scaling)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(
            f"{source}: rope type {rope_type!r} is not supported (default or llama3 only)."
        )
    for key, want in _MEGATRON_LLAMA3_ROPE.items():
        if float(params.get(key, want)) != float(want):
            raise ConfigError(
                f"{source}: rope_scaling.{key}={params.get(key)!r}; megatron-core's Llama-3 "
                f"rotary scaling supports only {want}."
            )
    return theta, float(params["factor"])


def rope_to_hf(cfg: DecoderModelConfig) -> dict[str, Any]:
    """HF ``rope_parameters`` for ``cfg``."""
    if cfg.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "rope_type": "llama3",
        "rope_theta": cfg.rope_theta,
        "factor": cfg.rope_scaling_factor,
        **_MEGATRON_LLAMA3_ROPE,
    }


def check_hf_basics(hf: dict[str, Any], source: str = "config.json") -> None:
    """Reject HF features the megatron model does not implement."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act={act!r}; only silu (SwiGLU) is supported.")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window=true is not supported.")


def common_from_hf(hf: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    """Fields every dense Llama-style HF config shares."""
    check_hf_basics(hf, source)
    theta, factor = rope_from_hf(hf, source)
    heads = int(hf["num_attention_heads"])
    return dict(
        name=name,
        flavor="hf",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rope_scaling_factor=factor,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(hf.get("attention_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def common_to_hf(cfg: DecoderModelConfig) -> dict[str, Any]:
    """HF config kwargs shared by the families."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.ffn_hidden_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope_to_hf(cfg),
        rms_norm_eps=cfg.norm_eps,
        attention_bias=cfg.attention_bias,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        hidden_act="silu",
    )


def dense_layer_spec(
    cfg: DecoderModelConfig, backend: str = "longboat", kernels: LayerKernels | None = None
) -> Any:
    """Decoder layer spec for any family in this package (qk-norm / MoE read from cfg)."""
    from longboat.core.megatron.specs import decoder_layer_spec

    return decoder_layer_spec(
        num_experts=cfg.num_experts,
        qk_norm=cfg.qk_norm,
        backend=backend,
        kernels=kernels,
        moe_experts=cfg.moe_experts,
    )
