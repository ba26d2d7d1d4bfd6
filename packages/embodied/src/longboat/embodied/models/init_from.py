"""``model.init_from``: start a run from released weights in LeRobot's policy format.

The architecture is the checkpoint's (its ``config.json``), not ``model.flavor``'s;
``model.overrides`` still apply on top (freezing, dtypes). The weights' names and shapes
are checked against that architecture when the config is resolved, before the dataset
opens or the model is built, and a mismatch lists every missing, unexpected and
mis-shaped key (a CheckpointError).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from longboat.core.checkpoint.errors import CheckpointError
from longboat.core.config.errors import ConfigError
from longboat.embodied.models.registry import apply_overrides, build_model, get_config

SUPPORTED = ("pi05",)
"""Families ``model.init_from`` reads (LeRobot's ``pi05`` policy format)."""


def _require_supported(name: str, init_from: str) -> None:
    if name not in SUPPORTED:
        raise ConfigError(
            f"reads LeRobot checkpoints of {', '.join(SUPPORTED)} only, not model.name={name!r}",
            key="model.init_from",
            value=init_from,
            fix="set model.name=pi05, or model.init_from=null",
        )


def resolve_model_config(
    name: str, flavor: str, overrides: Mapping[str, Any], init_from: str | None
) -> Any:
    """The family config of a run: ``name``/``flavor`` + ``overrides``, or with
    ``init_from`` the checkpoint's architecture + ``overrides``, its weights checked."""
    if not init_from:
        return get_config(name, flavor, overrides)
    _require_supported(name, init_from)
    from longboat.embodied.models.pi05.lerobot_format import (
        WEIGHTS_NAME,
        config_from_lerobot,
        from_lerobot_state_dict,
        read_lerobot_config,
    )

    cfg = apply_overrides(config_from_lerobot(read_lerobot_config(init_from)), overrides)
    path = Path(init_from) / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist (a LeRobot policy holds model.safetensors)")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())  # a safe_open handle is not iterable
            shapes = {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in names}
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from err
    from_lerobot_state_dict(build_model(name, cfg, device="meta"), shapes, source=str(path))
    return cfg


def load_initial_weights(model: nn.Module, name: str, init_from: str) -> None:
    """Copy the ``init_from`` checkpoint into ``model`` (built from ``resolve_model_config``)."""
    _require_supported(name, init_from)
    from longboat.embodied.models.pi05.lerobot_format import load_lerobot_weights

    load_lerobot_weights(model, init_from)


def config_from_dict(name: str, data: Mapping[str, Any]) -> Any:
    """Rebuild a family config from ``dataclasses.asdict`` output (an export's ``config``)."""
    _require_supported(name, "<export>")
    from longboat.embodied.models.common.image_preprocessing import ImagePreprocessConfig
    from longboat.embodied.models.common.lm import DecoderConfig
    from longboat.embodied.models.common.vit import ViTConfig
    from longboat.embodied.models.pi05.config import Pi05Config

    def build(cls: type, values: Mapping[str, Any]) -> Any:
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in values:
                v = values[f.name]
                kwargs[f.name] = tuple(v) if isinstance(v, list) else v
        return cls(**kwargs)

    rest = {k: v for k, v in data.items() if k not in ("vision", "llm", "expert", "image")}
    return build(
        Pi05Config,
        {
            **rest,
            "vision": build(ViTConfig, data["vision"]),
            "llm": build(DecoderConfig, data["llm"]),
            "expert": build(DecoderConfig, data["expert"]),
            "image": build(ImagePreprocessConfig, data["image"]),
        },
    )
