"""Build an LLM's megatron model chunks for this rank from a ``DecoderModelConfig``."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from longboat.core.family import find_family
from longboat.core.megatron.decoder_build import build_decoder
from longboat.core.megatron.decoder_config import DecoderModelConfig, to_transformer_config
from longboat.core.megatron.parallel_state import current_layout
from longboat.kernels.layers import longboat_layer_kernels
from longboat.llm.moe_aux_loss import pooled_aux_loss_applies


def build_model(
    cfg: DecoderModelConfig,
    *,
    precision: str = "fp32",
    device_type: str = "cpu",
    kernel_options: dict[str, bool] | None = None,
    **config_overrides: Any,
) -> list[torch.nn.Module]:
    """This rank's model chunks on longboat's kernels: the family ``cfg.name``'s
    ``chunk_builder``, else core's ``build_decoder`` with the family's layer spec.

    ``kernel_options``: switches of ``longboat_layer_kernels`` (e.g. ``{"add_rms_norm":
    False}``) for the longboat backend, to measure or rule out one kernel.
    An MoE model with ``moe_aux_loss`` ``auto`` or ``hf`` (and a non-zero coefficient) gets
    routers that record transformers' pooled load-balancing loss
    (``longboat.llm.moe_aux_loss``) where the layout allows it; training refuses an explicit
    ``hf`` it cannot honour first (``build_train_step``).
    """
    moe_router = None
    if pooled_aux_loss_applies(cfg, **aux_loss_layout(config_overrides)):
        from longboat.llm.pooled_aux_router import PooledAuxRouter

        # transformers' pooled term replaces megatron's per-layer one (train.step adds it).
        config_overrides.setdefault("moe_router_load_balancing_type", "none")
        moe_router = PooledAuxRouter
    family = find_family("llm", cfg.name)
    if family.chunk_builder is not None:
        build = family.chunk_builder
    else:
        build = partial(
            build_decoder, layer_spec=family.layer_spec, transformer_config=to_transformer_config
        )
    return build(
        cfg,
        kernels=longboat_layer_kernels(**(kernel_options or {})),
        moe_router=moe_router,
        precision=precision,
        device_type=device_type,
        layout=current_layout(),
        **config_overrides,
    )


def aux_loss_layout(config_overrides: dict[str, Any]) -> dict[str, Any]:
    """What ``moe_aux_loss.pooled_aux_loss_problems`` needs of the live parallel layout and
    of megatron ``TransformerConfig`` overrides (sequence parallel, recompute)."""
    layout = current_layout()
    return {
        "pipeline_parallel": layout.pipeline_parallel if layout else 1,
        "context_parallel": layout.context_parallel if layout else 1,
        "sequence_parallel": bool(config_overrides.get("sequence_parallel")),
        "full_recompute": config_overrides.get("recompute_granularity") == "full",
    }
