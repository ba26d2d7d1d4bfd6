"""Hugging Face ``config.json`` <-> ``DecoderModelConfig``: the rotary and shared-field
helpers (transformers 4.x and 5.x layouts) and the config dialects of the decoder kinds
longboat builds (Llama, Qwen2 with optional M-RoPE, Qwen3, Qwen3-MoE).

These are building blocks: the llm stack's families read and write their HF configs with
them, and the vlm stack reads and writes the language model inside a VLM's config with
them. A dialect is found by its HF ``model_type`` / ``architectures`` (``hf_dialect_for``)
or by the decoder name a ``DecoderModelConfig`` carries (``hf_dialect``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.config.suggest import did_you_mean
from longboat.core.megatron.decoder_config import DecoderModelConfig

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


def llama_from_hf_config(hf: dict[str, Any]) -> DecoderModelConfig:
    """Model config from a Llama ``config.json`` dict."""
    if hf.get("mlp_bias"):
        raise ConfigError("config.json: mlp_bias=true is not supported for llama3.")
    return DecoderModelConfig(**common_from_hf(hf, "llama3", "config.json"))


def llama_to_hf_config(cfg: DecoderModelConfig) -> Any:
    """``transformers.LlamaConfig`` for ``cfg``."""
    from transformers import LlamaConfig

    return LlamaConfig(**common_to_hf(cfg), architectures=["LlamaForCausalLM"])


QWEN2_5_VL_MROPE = [16, 24, 24]
"""transformers' default M-RoPE sections for Qwen2.5-VL (head_dim 128) when the config has none."""


def mrope_from_hf(hf: dict[str, Any], source: str) -> tuple[dict[str, Any], list[int] | None]:
    """``(config without the M-RoPE entries, mrope_section or None)``: a Qwen2.5-VL text
    config names its rotary ``mrope`` / ``default`` with a ``mrope_section``; the rest of
    its rotary is plain."""
    hf = dict(hf)
    section = None
    for key in ("rope_parameters", "rope_scaling"):
        params = dict(hf.get(key) or {})
        if "mrope_section" in params:
            section = [int(x) for x in params.pop("mrope_section")]
        if params.get("rope_type", params.get("type")) == "mrope":
            params["rope_type"] = "default"
            params.pop("type", None)
        if params:
            hf[key] = params
        else:
            hf.pop(key, None)
    if hf.get("model_type") == "qwen2_5_vl_text" and section is None:
        section = list(QWEN2_5_VL_MROPE)
    if section is not None and len(section) != 3:
        raise ConfigError(f"{source}: mrope_section={section!r}: expected three sizes.")
    return hf, section


def qwen2_from_hf_config(hf: dict[str, Any]) -> DecoderModelConfig:
    """Model config from a Qwen2 ``config.json`` dict (q/k/v biases always on, no qk-norm)."""
    hf, section = mrope_from_hf(hf, "config.json")
    fields = common_from_hf(hf, "qwen2", "config.json")
    fields["attention_bias"] = True
    return DecoderModelConfig(**fields, qk_norm=False, mrope_section=section)


def qwen2_to_hf_config(cfg: DecoderModelConfig) -> Any:
    """``transformers.Qwen2Config`` for ``cfg`` (a plain-rotary decoder)."""
    from transformers import Qwen2Config

    if cfg.mrope_section is not None:
        raise ConfigError(
            "model.mrope_section is set: an M-RoPE decoder is the language model of a VLM "
            "and is exported with it (longboat-vlm), not as a Qwen2ForCausalLM."
        )
    kwargs = common_to_hf(cfg)
    kwargs.pop("attention_bias")
    return Qwen2Config(**kwargs, use_sliding_window=False, architectures=["Qwen2ForCausalLM"])


def qwen3_from_hf_config(hf: dict[str, Any]) -> DecoderModelConfig:
    """Model config from a Qwen3 ``config.json`` dict (qk-norm always on)."""
    return DecoderModelConfig(**common_from_hf(hf, "qwen3", "config.json"), qk_norm=True)


def qwen3_to_hf_config(cfg: DecoderModelConfig) -> Any:
    """``transformers.Qwen3Config`` for ``cfg``."""
    from transformers import Qwen3Config

    return Qwen3Config(**common_to_hf(cfg), architectures=["Qwen3ForCausalLM"])


def qwen3_moe_from_hf_config(hf: dict[str, Any]) -> DecoderModelConfig:
    """Model config from a Qwen3-MoE ``config.json`` dict (every layer sparse)."""
    problems = []
    if hf.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers={hf['mlp_only_layers']!r} (must be empty)")
    if int(hf.get("decoder_sparse_step", 1)) != 1:
        problems.append(f"decoder_sparse_step={hf['decoder_sparse_step']!r} (must be 1)")
    if problems:
        raise ConfigError(
            "config.json: unsupported Qwen3-MoE layout: "
            + "; ".join(problems)
            + ". longboat's Qwen3-MoE makes every layer an MoE layer."
        )
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    return DecoderModelConfig(
        **common_from_hf(hf, "qwen3_moe", "config.json"),
        qk_norm=True,
        num_experts=int(experts),
        moe_topk=int(hf["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
    )


def qwen3_moe_to_hf_config(cfg: DecoderModelConfig) -> Any:
    """``transformers.Qwen3MoeConfig`` for ``cfg``."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **common_to_hf(cfg),
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_topk,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        norm_topk_prob=cfg.moe_norm_topk_prob,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        architectures=["Qwen3MoeForCausalLM"],
    )


@dataclass(frozen=True)
class HFDecoderDialect:
    """How one decoder kind is spelled in an HF ``config.json``."""

    name: str
    """The decoder name a ``DecoderModelConfig`` of this kind carries (``model.name``)."""
    model_types: tuple[str, ...]
    """HF ``model_type`` values of this kind."""
    architectures: tuple[str, ...]
    """HF ``architectures`` class names (read when ``model_type`` is absent or unknown)."""
    from_hf_config: Callable[[dict[str, Any]], DecoderModelConfig]
    """HF config dict -> decoder config."""
    to_hf_config: Callable[[DecoderModelConfig], Any]
    """Decoder config -> a ``transformers`` config object (``save_pretrained`` writes it)."""


HF_DECODER_DIALECTS: tuple[HFDecoderDialect, ...] = (
    HFDecoderDialect("llama3", ("llama",), ("LlamaForCausalLM",),
                     llama_from_hf_config, llama_to_hf_config),
    HFDecoderDialect("qwen2", ("qwen2", "qwen2_5_vl_text"), ("Qwen2ForCausalLM",),
                     qwen2_from_hf_config, qwen2_to_hf_config),
    HFDecoderDialect("qwen3", ("qwen3",), ("Qwen3ForCausalLM",),
                     qwen3_from_hf_config, qwen3_to_hf_config),
    HFDecoderDialect("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",),
                     qwen3_moe_from_hf_config, qwen3_moe_to_hf_config),
)  # fmt: skip
"""The decoder kinds longboat reads and writes HF configs of."""


def hf_dialect(name: str) -> HFDecoderDialect:
    """The dialect of decoder ``name`` (``DecoderModelConfig.name``); ``ConfigError`` otherwise."""
    for dialect in HF_DECODER_DIALECTS:
        if dialect.name == name:
            return dialect
    raise ConfigError(
        "no Hugging Face config dialect for this decoder",
        key="model.name",
        value=name,
        fix=did_you_mean(name, [d.name for d in HF_DECODER_DIALECTS], what="decoders"),
    )


def hf_dialect_for(hf: dict[str, Any], source: str = "config.json") -> HFDecoderDialect:
    """The dialect of an HF config dict: by ``model_type``, else by ``architectures``."""
    model_type = hf.get("model_type")
    for dialect in HF_DECODER_DIALECTS:
        if model_type in dialect.model_types:
            return dialect
    archs = set(hf.get("architectures") or ())
    for dialect in HF_DECODER_DIALECTS:
        if archs & set(dialect.architectures):
            return dialect
    known = sorted(t for d in HF_DECODER_DIALECTS for t in d.model_types)
    raise ConfigError(
        f"{source}: model_type={model_type!r} is not a supported decoder "
        f"(architectures: {sorted(archs)})",
        fix=f"use a checkpoint of one of {known}",
    )
