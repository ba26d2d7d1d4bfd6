"""Build an LLM's megatron model chunks for this rank from an ``LLMModelConfig``."""

from __future__ import annotations

from typing import Any

import torch

from longboat.core.megatron.decoder_config import to_transformer_config
from longboat.core.megatron.models.build import build_decoder
from longboat.core.megatron.parallel_state import current_layout
from longboat.llm.config import LLMModelConfig
from longboat.llm.layer_kernels import longboat_layer_kernels


def build_model(
    cfg: LLMModelConfig,
    *,
    precision: str = "fp32",
    device_type: str = "cpu",
    kernel_options: dict[str, bool] | None = None,
    **config_overrides: Any,
) -> list[torch.nn.Module]:
    """This rank's model chunks on longboat's kernels (core's ``build_decoder``).

    ``kernel_options``: switches of ``longboat_layer_kernels`` (e.g. ``{"add_rms_norm":
    False}``) for the longboat backend, to measure or rule out one kernel.
    """
    return build_decoder(
        cfg,
        kernels=longboat_layer_kernels(**(kernel_options or {})),
        precision=precision,
        device_type=device_type,
        layout=current_layout(),
        transformer_config=to_transformer_config,
        **config_overrides,
    )
