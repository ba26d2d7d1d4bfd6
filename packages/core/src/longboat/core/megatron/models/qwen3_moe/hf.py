"""Qwen3-MoE <-> Hugging Face ``Qwen3MoeForCausalLM`` config."""

from __future__ import annotations

from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.models.common import common_from_hf, common_to_hf
from longboat.core.megatron.models.config import DecoderModelConfig


def from_hf_config(hf: dict[str, Any]) -> DecoderModelConfig:
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


def to_hf_config(cfg: DecoderModelConfig) -> Any:
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
