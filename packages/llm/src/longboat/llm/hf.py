"""Hugging Face directories <-> longboat LLM megatron models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.hf_io import load_hf_weights, save_hf_weights
from longboat.llm.config import ARCH_FIELDS, LLMModelConfig
from longboat.llm.models.registry import family_for_hf_config, get_family


def read_hf_config(hf_dir: str | Path) -> LLMModelConfig:
    """The model config described by ``<hf_dir>/config.json`` (family from ``model_type``)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found. Fix: point at a Hugging Face model directory.")
    hf = json.loads(path.read_text())
    return family_for_hf_config(hf).from_hf_config(hf)


def check_matches_flavor(cfg: LLMModelConfig, hf_cfg: LLMModelConfig, source: str) -> None:
    """Raise ``ConfigError`` listing every architecture field where the two configs differ."""
    diffs = []
    if cfg.name != hf_cfg.name:
        diffs.append(f"model.name={cfg.name!r} but {source} is a {hf_cfg.name!r} checkpoint")
    for name in ARCH_FIELDS:
        a, b = getattr(cfg, name), getattr(hf_cfg, name)
        if a != b:
            diffs.append(f"model.{name}={a!r} but {source} has {b!r}")
    if diffs:
        raise ConfigError(
            f"model flavor {cfg.name}/{cfg.flavor} does not match {source}:\n  "
            + "\n  ".join(diffs)
            + "\nFix: drop the model.* overrides (and model=<option>): with "
            "model.init_from the architecture comes from config.json."
        )


def load_hf(
    chunks: list[torch.nn.Module],
    cfg: LLMModelConfig,
    hf_dir: str | Path,
    *,
    progress: Any = None,
) -> int:
    """Load ``hf_dir`` into this rank's chunks after checking it matches ``cfg``."""
    check_matches_flavor(cfg, read_hf_config(hf_dir), f"{hf_dir}/config.json")
    fam = get_family(cfg.name)
    return load_hf_weights(chunks, cfg.to_arch(), hf_dir, prefix=fam.hf_prefix, progress=progress)


def save_hf(chunks: list[torch.nn.Module], cfg: LLMModelConfig, out_dir: str | Path) -> Path:
    """Write config.json + safetensors that ``transformers`` loads (collective)."""
    out_dir = Path(out_dir)
    fam = get_family(cfg.name)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        hf_config = fam.to_hf_config(cfg)
        hf_config.dtype = "float32"
        hf_config.save_pretrained(out_dir)
    save_hf_weights(chunks, cfg.to_arch(), out_dir, prefix=fam.hf_prefix)
    return out_dir
