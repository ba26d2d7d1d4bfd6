"""LoRA adapters of an LLM as PEFT files, and PEFT adapters as the start of a LoRA run.

The format and the mapping live in ``longboat.core.megatron.peft`` (the vlm stack writes
its language model's adapters with them too); here the decoder's place in the transformers
model is the family's ``hf_prefix``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from longboat.core.megatron import peft as core_peft
from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.peft import CONFIG_NAME, WEIGHTS_NAME, read_peft


def _prefix(cfg: DecoderModelConfig) -> str:
    from longboat.core.family import find_family

    return find_family("llm", cfg.name).hf_prefix


def save_peft(
    chunks: list[torch.nn.Module],
    cfg: DecoderModelConfig,
    out_dir: str | Path,
    *,
    rank: int,
    alpha: float,
    base_model: str | None = None,
) -> Path:
    """Write this model's LoRA adapters as a PEFT adapter directory (collective)."""
    return core_peft.save_peft(
        chunks, cfg, out_dir, rank=rank, alpha=alpha, prefix=_prefix(cfg), base_model=base_model
    )


def load_peft(
    chunks: list[torch.nn.Module], cfg: DecoderModelConfig, adapter_dir: str | Path
) -> int:
    """Set every adapter of ``chunks`` (``apply_lora`` first) from a PEFT adapter; returns how
    many were set (``longboat.core.megatron.peft.load_peft``)."""
    return core_peft.load_peft(chunks, cfg, adapter_dir, prefix=_prefix(cfg))


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "load_peft", "read_peft", "save_peft"]
