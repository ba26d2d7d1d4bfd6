"""Hugging Face checkpoint directories (config.json + safetensors) <-> longboat LLM megatron
models: the family from the config's ``model_type``, its weights through core's mapping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longboat.core.config.errors import ConfigError
from longboat.core.family import families, find_family
from longboat.core.megatron.decoder_config import DecoderModelConfig

if TYPE_CHECKING:
    import torch

    from longboat.llm.models.family import LLMFamily


def family_for_hf_config(hf: dict[str, Any]) -> LLMFamily:
    """The llm family of an HF ``config.json`` dict: by ``model_type``, else ``architectures``."""
    found = families("llm")
    model_type = hf.get("model_type")
    for fam in found.values():
        if model_type in fam.checkpoint_types:
            return fam
    archs = set(hf.get("architectures") or ())
    for fam in found.values():
        if archs & set(fam.checkpoint_types):
            return fam
    known = sorted(t for f in found.values() for t in f.adapter.dialect.model_types)
    raise ConfigError(
        f"config.json model_type={model_type!r} is not supported (architectures: {sorted(archs)})",
        fix=f"use a checkpoint of one of {known}",
    )


def read_hf_config(hf_dir: str | Path) -> DecoderModelConfig:
    """The model config described by ``<hf_dir>/config.json`` (family from ``model_type``)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found. Fix: point at a Hugging Face model directory.")
    hf = json.loads(path.read_text())
    return family_for_hf_config(hf).from_hf_config(hf)


def check_matches_flavor(cfg: DecoderModelConfig, hf_cfg: DecoderModelConfig, source: str) -> None:
    """Raise ``ConfigError`` listing every architecture field where the two configs differ."""
    diffs = []
    if cfg.name != hf_cfg.name:
        diffs.append(f"model.name={cfg.name!r} but {source} is a {hf_cfg.name!r} checkpoint")
    for name in hf_cfg.architecture():
        a, b = getattr(cfg, name, None), getattr(hf_cfg, name)
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
    cfg: DecoderModelConfig,
    hf_dir: str | Path,
    *,
    progress: Any = None,
) -> int:
    """Load ``hf_dir`` into this rank's chunks after checking it matches ``cfg``."""
    from longboat.core.megatron.hf_io import load_hf_weights

    check_matches_flavor(cfg, read_hf_config(hf_dir), f"{hf_dir}/config.json")
    fam = find_family("llm", cfg.name)
    if fam.adapter.weights is not None:
        return int(fam.adapter.weights.load(chunks, cfg, hf_dir, progress=progress))
    return load_hf_weights(chunks, cfg, hf_dir, prefix=fam.hf_prefix, progress=progress)


def save_hf(chunks: list[torch.nn.Module], cfg: DecoderModelConfig, out_dir: str | Path) -> Path:
    """Write config.json + safetensors that ``transformers`` loads (collective)."""
    import torch.distributed as dist

    from longboat.core.megatron.hf_io import save_hf_weights

    out_dir = Path(out_dir)
    fam = find_family("llm", cfg.name)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        hf_config = fam.to_hf_config(cfg)
        hf_config.dtype = "float32"
        hf_config.save_pretrained(out_dir)
    if fam.adapter.weights is not None:
        fam.adapter.weights.save(chunks, cfg, out_dir)
    else:
        save_hf_weights(chunks, cfg, out_dir, prefix=fam.hf_prefix)
    return out_dir
