"""Qwen3 decoder layer: Llama-style with per-head RMSNorm on queries and keys."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from longboat.llm.config import LLMModelConfig
from longboat.llm.models._hf_common import dense_layer_spec

if TYPE_CHECKING:
    from longboat.core.megatron.specs import LayerKernels


def layer_spec(
    cfg: LLMModelConfig, backend: str = "longboat", kernels: LayerKernels | None = None
) -> Any:
    """megatron ``ModuleSpec`` of one Qwen3 decoder layer (qk-norm on)."""
    return dense_layer_spec(cfg, backend, kernels)
