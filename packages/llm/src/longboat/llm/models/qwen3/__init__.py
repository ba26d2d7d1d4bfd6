"""Qwen3 dense (GQA, qk-norm, decoupled head_dim)."""

from longboat.llm.models.family import decoder_family
from longboat.llm.models.qwen3.config import FLAVORS

FAMILY = decoder_family(
    "qwen3", FLAVORS, description="Qwen3 dense: GQA, qk-norm, head_dim decoupled from width"
)
