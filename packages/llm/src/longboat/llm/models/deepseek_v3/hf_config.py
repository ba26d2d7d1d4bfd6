"""DeepSeek-V3 ``config.json`` (transformers' ``DeepseekV3Config``) <-> ``DeepseekV3Config``.

Moonlight and Kimi K2 ship the same architecture (``architectures: DeepseekV3ForCausalLM``;
Kimi K2's ``model_type`` is ``kimi_k2``); exports are written as ``deepseek_v3``. DeepSeek-V3.2
(``model_type: deepseek_v32``, ``DeepseekV32ForCausalLM``) adds the sparse attention's
lightning indexer (``index_topk``, ``index_n_heads``, ``index_head_dim``); a config with
``index_topk`` is written as ``deepseek_v32``.
"""

from __future__ import annotations

from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.hf_decoder_config import HFDecoderDialect, check_hf_basics
from longboat.llm.models.deepseek_v3.config import DeepseekV3Config

SOURCE = "config.json"


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and the ``yarn_*`` fields from ``rope_parameters`` / ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return {"rope_theta": theta, "yarn_factor": None, "yarn_mscale_all_dim": 0.0}
    if kind != "yarn":
        raise ConfigError(f"{SOURCE}: rope type {kind!r} is not supported (default or yarn only).")
    if params.get("attention_factor") is not None or params.get("truncate", True) is not True:
        raise ConfigError(
            f"{SOURCE}: rope_scaling.attention_factor / truncate=false are not supported "
            "(megatron's YaRN derives the factor from mscale and rounds the correction range)."
        )
    original = int(params.get("original_max_position_embeddings", 4096))
    factor = params.get("factor") or int(hf["max_position_embeddings"]) / original
    mscale = float(params.get("mscale") or 1.0)
    all_dim = float(params.get("mscale_all_dim") or 0.0)
    if not all_dim and mscale != 1.0:
        raise ConfigError(
            f"{SOURCE}: rope_scaling.mscale={mscale} without mscale_all_dim is not supported."
        )
    return {
        "rope_theta": theta,
        "yarn_factor": float(factor),
        "yarn_original_max_position_embeddings": original,
        "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
        "yarn_beta_slow": float(params.get("beta_slow") or 1.0),
        "yarn_mscale": mscale,
        "yarn_mscale_all_dim": all_dim,
    }


def _rope_to_hf(cfg: DeepseekV3Config) -> dict[str, Any]:
    if cfg.yarn_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "rope_type": "yarn",
        "rope_theta": cfg.rope_theta,
        "factor": cfg.yarn_factor,
        "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
        "beta_fast": cfg.yarn_beta_fast,
        "beta_slow": cfg.yarn_beta_slow,
        "mscale": cfg.yarn_mscale,
        "mscale_all_dim": cfg.yarn_mscale_all_dim,
    }


def _index_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The lightning indexer's fields of a DeepSeek-V3.2 ``config.json``."""
    return {
        "index_topk": int(hf.get("index_topk", 2048)),
        "index_n_heads": int(hf.get("index_n_heads", 64)),
        "index_head_dim": int(hf.get("index_head_dim", 128)),
    }


def from_hf_config(hf: dict[str, Any]) -> DeepseekV3Config:
    """Model config from a DeepSeek-V3 / Moonlight / Kimi K2 ``config.json`` dict."""
    check_hf_basics(hf, SOURCE)
    problems = []
    if hf.get("rope_interleave", True) is not True:
        problems.append("rope_interleave=false (megatron's MLA rotates interleaved pairs)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func={hf['scoring_func']!r} (sigmoid only)")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"topk_method={hf['topk_method']!r} (noaux_tc only)")
    if int(hf.get("moe_layer_freq", 1)) != 1:
        problems.append(f"moe_layer_freq={hf['moe_layer_freq']!r} (1 only)")
    if hf.get("attention_bias"):
        problems.append("attention_bias=true")
    sparse = hf.get("model_type") == "deepseek_v32"
    if sparse and hf.get("q_lora_rank") is None:
        problems.append("q_lora_rank=null with sparse attention (the indexer reads the q latent)")
    if problems:
        raise ConfigError(f"{SOURCE}: unsupported DeepSeek-V3 layout: " + "; ".join(problems))
    heads = int(hf["num_attention_heads"])
    nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    q_rank = hf.get("q_lora_rank")
    cfg = DeepseekV3Config(
        name="deepseek_v3",
        flavor="hf",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=nope + rope,
        ffn_hidden_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        num_experts=int(hf["n_routed_experts"]),
        moe_topk=int(hf["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        moe_norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_aux_loss_coeff=float(hf.get("aux_loss_alpha", 0.0) or 0.0),
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(hf["v_head_dim"]),
        first_k_dense=int(hf.get("first_k_dense_replace", 0) or 0),
        num_shared_experts=int(hf.get("n_shared_experts") or 0),
        moe_router_num_groups=int(hf.get("n_group") or 1),
        moe_router_group_topk=int(hf.get("topk_group") or 1),
        moe_routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        mtp_num_layers=int(hf.get("num_nextn_predict_layers", 0) or 0),
        **_rope_from_hf(hf),
        **(_index_from_hf(hf) if sparse else {}),
    )
    cfg.validate(prefix=SOURCE)
    return cfg


def to_hf_config(cfg: DeepseekV3Config) -> Any:
    """``transformers.DeepseekV3Config`` for ``cfg`` (``DeepseekV32Config`` with sparse
    attention)."""
    import transformers

    sparse = cfg.index_topk is not None
    extra: dict[str, Any] = {}
    if sparse:
        extra = dict(
            index_topk=cfg.index_topk,
            index_n_heads=cfg.index_n_heads,
            index_head_dim=cfg.index_head_dim,
        )
    HFConfig = transformers.DeepseekV32Config if sparse else transformers.DeepseekV3Config
    return HFConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        n_shared_experts=cfg.num_shared_experts,
        n_routed_experts=cfg.num_experts,
        routed_scaling_factor=cfg.moe_routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.moe_router_num_groups,
        topk_group=cfg.moe_router_group_topk,
        num_experts_per_tok=cfg.moe_topk,
        first_k_dense_replace=cfg.first_k_dense,
        norm_topk_prob=cfg.moe_norm_topk_prob,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=_rope_to_hf(cfg),
        rope_interleave=True,
        attention_bias=False,
        num_nextn_predict_layers=cfg.mtp_num_layers,
        aux_loss_alpha=cfg.moe_aux_loss_coeff,
        architectures=["DeepseekV32ForCausalLM" if sparse else "DeepseekV3ForCausalLM"],
        **extra,
    )


DIALECT = HFDecoderDialect(
    "deepseek_v3",
    ("deepseek_v3", "kimi_k2", "deepseek_v32"),
    ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"),
    from_hf_config,
    to_hf_config,
)
"""How a DeepSeek-V3 checkpoint's ``config.json`` is spelled."""
