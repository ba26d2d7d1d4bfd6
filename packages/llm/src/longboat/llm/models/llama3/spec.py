"""Llama 3 decoder layer: RMSNorm, GQA attention with rotary, SwiGLU MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from longboat.llm.config import LLMModelConfig
from longboat.llm.models._hf_common import dense_layer_spec

if TYPE_CHECKING:
    from longboat.core.megatron.specs import LayerKernels


def layer_spec(
    cfg: LLMModelConfig, backend: str = "longboat", kernels: LayerKernels | None = None
) -> Any:
    """megatron ``ModuleSpec`` of one Llama 3 decoder layer."""
    return dense_layer_spec(cfg, backend, kernels)
