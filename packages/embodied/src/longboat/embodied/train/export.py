"""Export a trained policy as ``model.safetensors`` + ``config.json``, and load it back."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from longboat.embodied.models import build_model, get_config
from longboat.embodied.models.init_from import config_from_dict

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
EXPORT_FORMAT = "longboat-embodied-policy/1"


def export_policy(
    model: nn.Module,
    out_dir: str | Path,
    *,
    model_name: str,
    flavor: str,
    overrides: dict[str, Any],
    model_cfg: Any,
    extra: dict[str, Any] | None = None,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write the full (unsharded) weights and the config; every rank must call it.

    Works under DDP, ZeRO-1, FSDP2 and HSDP: the state dict is gathered to full
    tensors on CPU (a collective), rank 0 writes. Keys are the policy's own FQNs, after
    ``transform`` (e.g. LoRA adapters merged into their base weights) where given.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    out = Path(out_dir)
    is_main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if is_main:
        if transform is not None:
            state = transform(state)
        out.mkdir(parents=True, exist_ok=True)
        # clone: tied weights share storage, which safetensors refuses to write twice.
        tensors = {k: v.detach().cpu().clone().contiguous() for k, v in state.items()}
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        config = {
            "format": EXPORT_FORMAT,
            "model_name": model_name,
            "flavor": flavor,
            "overrides": overrides,
            "config": dataclasses.asdict(model_cfg),
            **(extra or {}),
        }
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, default=str) + "\n")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return out


def load_exported_policy(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild an exported policy (config.json) and load its weights (dtypes as saved)."""
    path = Path(path)
    config = json.loads((path / CONFIG_NAME).read_text())
    if config.get("format") != EXPORT_FORMAT:
        raise ValueError(
            f"{path / CONFIG_NAME} is not a longboat-embodied export (format "
            f"{config.get('format')!r}, expected {EXPORT_FORMAT!r})"
        )
    if config.get("init_from"):  # the architecture came from a LeRobot config.json
        cfg = config_from_dict(config["model_name"], config["config"])
    else:
        cfg = get_config(config["model_name"], config["flavor"], config.get("overrides") or {})
    model = build_model(config["model_name"], cfg)
    weights = load_file(str(path / WEIGHTS_NAME), device=str(device))
    model.load_state_dict(weights, strict=True, assign=True)
    return model.to(device)
