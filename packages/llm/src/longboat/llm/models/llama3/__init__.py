"""Llama 3 (dense, GQA, Llama-3 rotary scaling)."""

from longboat.llm.models.family import decoder_family
from longboat.llm.models.llama3.config import FLAVORS

FAMILY = decoder_family(
    "llama3", FLAVORS, description="Llama 3: dense decoder, GQA, Llama-3 rotary scaling"
)
