"""Qwen3-MoE (every layer sparse, top-k routing, no shared expert)."""

from longboat.llm.models.family import decoder_family
from longboat.llm.models.qwen3_moe.config import FLAVORS

FAMILY = decoder_family(
    "qwen3_moe", FLAVORS, description="Qwen3-MoE: qk-norm decoder, every layer top-k routed"
)
