"""LoRA adapters of an LLM as PEFT files, and PEFT adapters as the start of a LoRA run.

The format and the mapping live in ``longboat.core.megatron.peft`` (the vlm stack writes
its language model's adapters with them too); here the decoder's place in the transformers
model is the family's ``hf_prefix``, and a family with its own tensor names (DeepSeek-V3's
latent attention) gives their mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from longboat.core.megatron import peft as core_peft
from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.peft import CONFIG_NAME, WEIGHTS_NAME, read_peft


def _mapping(cfg: DecoderModelConfig) -> dict[str, Any]:
    """The family's place in the transformers model and, for a family with its own tensor
    names, their mapping (its ``lora_targets.peft_slot``)."""
    from longboat.core.family import find_family

    family = find_family("llm", cfg.name)
    targets = getattr(family, "lora_targets", None)
    return {"prefix": family.hf_prefix, "slot_of": getattr(targets, "peft_slot", None)}


def _save_options(cfg: DecoderModelConfig) -> dict[str, Any]:
    from longboat.core.family import find_family

    targets = getattr(find_family("llm", cfg.name), "lora_targets", None)
    return {**_mapping(cfg), "as_parameter": getattr(targets, "peft_parameter", None)}


def peft_export_problem(cfg: DecoderModelConfig, targets: list[str]) -> str | None:
    """Why this model's adapters on ``targets`` have no PEFT adapter form (None: they have;
    the family's ``lora_targets.peft_export_problem``, e.g. DeepSeek-V3's routed experts)."""
    from longboat.core.family import find_family

    own = getattr(find_family("llm", cfg.name), "lora_targets", None)
    check = getattr(own, "peft_export_problem", None)
    return None if check is None else check(cfg, list(targets))


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
        chunks, cfg, out_dir, rank=rank, alpha=alpha, base_model=base_model, **_save_options(cfg)
    )


def load_peft(
    chunks: list[torch.nn.Module], cfg: DecoderModelConfig, adapter_dir: str | Path
) -> int:
    """Set every adapter of ``chunks`` (``apply_lora`` first) from a PEFT adapter; returns how
    many were set (``longboat.core.megatron.peft.load_peft``)."""
    return core_peft.load_peft(chunks, cfg, adapter_dir, **_mapping(cfg))


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "load_peft", "peft_export_problem", "read_peft",
           "save_peft"]  # fmt: skip
