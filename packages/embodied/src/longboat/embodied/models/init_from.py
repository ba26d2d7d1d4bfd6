"""``model.init_from``: start a run from released weights (pi0.5 in LeRobot's policy format,
GR00T N1.6 in the Isaac-GR00T release layout), or from a Hugging Face backbone alone
(``hf_backbones``: PaliGemma / SigLIP / Gemma for pi0.5, SigLIP2 / Qwen3 for GR00T; the
architecture is then ``model.flavor``'s, checked against the backbone's config.json, and
only that part is loaded).

The architecture is the checkpoint's (its ``config.json``), not ``model.flavor``'s;
``model.overrides`` still apply on top (freezing, dtypes). The weights' names and shapes
are checked against that architecture when the config is resolved, before the dataset
opens or the model is built, and a mismatch lists every missing, unexpected and
mis-shaped key (a CheckpointError).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from longboat.core.checkpoint.errors import CheckpointError
from longboat.core.config.errors import ConfigError
from longboat.embodied.models import hf_backbones
from longboat.embodied.models.registry import apply_overrides, build_model, get_config

SUPPORTED = ("pi05", "groot_n1_6")
"""Families ``model.init_from`` reads: pi05 in LeRobot's policy format, groot_n1_6 in the
Isaac-GR00T N1.6 release layout (a LeRobot ``groot`` directory, GR00T N1.7, is refused
with the keys that do not fit)."""


def _require_supported(name: str, init_from: str) -> None:
    if name not in SUPPORTED:
        raise ConfigError(
            f"reads checkpoints of {', '.join(SUPPORTED)} only, not model.name={name!r}",
            key="model.init_from",
            value=init_from,
            fix="set model.name to one of those, or model.init_from=null",
        )


def groot_checkpoint_kind(init_from: str) -> str:
    """``isaac`` (an Isaac-GR00T N1.6 directory) or ``lerobot`` (a LeRobot groot policy),
    from its config.json."""
    from longboat.embodied.models.groot_n1_6.isaac_format import MODEL_TYPE, read_json_config

    raw = read_json_config(init_from)
    if raw.get("model_type") == MODEL_TYPE:
        return "isaac"
    if raw.get("type") == "groot":
        return "lerobot"
    raise ConfigError(
        f"{Path(init_from) / 'config.json'} is neither an Isaac-GR00T N1.6 checkpoint "
        f"(model_type={raw.get('model_type')!r}) nor a LeRobot groot policy "
        f"(type={raw.get('type')!r})",
        key="model.init_from",
        fix='use a directory whose config.json has "model_type": "Gr00tN1d6"',
    )


def _resolve_groot(overrides: Mapping[str, Any], init_from: str) -> Any:
    from longboat.embodied.models.groot_n1_6 import isaac_format, lerobot_format

    if groot_checkpoint_kind(init_from) == "lerobot":
        _, base = lerobot_format.read_lerobot_groot(init_from)
        cfg = apply_overrides(lerobot_format.config_from_lerobot_groot(base), overrides)
        lerobot_format.refuse_for_init_from(
            build_model("groot_n1_6", cfg, device="meta"), init_from
        )
        return cfg  # not reached: refuse_for_init_from always raises
    raw = isaac_format.read_isaac_config(init_from)
    cfg = apply_overrides(isaac_format.config_from_isaac(raw), overrides)
    isaac_format.check_isaac_weights(build_model("groot_n1_6", cfg, device="meta"), init_from)
    return cfg


def resolve_model_config(
    name: str, flavor: str, overrides: Mapping[str, Any], init_from: str | None
) -> Any:
    """The family config of a run: ``name``/``flavor`` + ``overrides``, or with
    ``init_from`` the checkpoint's architecture + ``overrides``, its weights checked."""
    if not init_from:
        return get_config(name, flavor, overrides)
    _require_supported(name, init_from)
    if hf_backbones.is_hf_backbone(init_from):
        backbone = hf_backbones.read_backbone(init_from, name)
        cfg = get_config(name, flavor, overrides)
        hf_backbones.check_backbone_config(backbone, cfg)
        from longboat.embodied.models.groot_n1_6.isaac_format import read_shapes

        _family_adapter(name).backbone_state(
            build_model(name, cfg, device="meta"), backbone, read_shapes(init_from)
        )
        return cfg
    if name == "groot_n1_6":
        return _resolve_groot(overrides, init_from)
    from longboat.embodied.models.groot_n1_6.isaac_format import read_shapes
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
    shapes = read_shapes(init_from)
    from_lerobot_state_dict(build_model(name, cfg, device="meta"), shapes, source=str(path))
    return cfg


def _family_adapter(name: str) -> Any:
    if name == "groot_n1_6":
        from longboat.embodied.models.groot_n1_6 import hf_backbone
    else:
        from longboat.embodied.models.pi05 import hf_backbone
    return hf_backbone


def load_initial_weights(model: nn.Module, name: str, init_from: str) -> str | None:
    """Copy the ``init_from`` checkpoint into ``model`` (built from ``resolve_model_config``);
    for a Hugging Face backbone, the one line saying what was loaded and what stays
    initialised (None for a full checkpoint)."""
    _require_supported(name, init_from)
    if hf_backbones.is_hf_backbone(init_from):
        from longboat.embodied.models.groot_n1_6.isaac_format import read_tensors

        backbone = hf_backbones.read_backbone(init_from, name)
        hf_backbones.check_backbone_config(backbone, model.cfg)
        adapter = _family_adapter(name)
        ours = adapter.backbone_state(model, backbone, read_tensors(init_from))
        left = hf_backbones.load_part(model, ours)
        return hf_backbones.summary_line(backbone, len(ours), adapter.initialised_parts(left))
    if name == "groot_n1_6":
        from longboat.embodied.models.groot_n1_6.isaac_format import load_isaac_weights

        load_isaac_weights(model, init_from)
        return None
    from longboat.embodied.models.pi05.lerobot_format import load_lerobot_weights

    load_lerobot_weights(model, init_from)
    return None


def _build_dataclass(cls: type, values: Mapping[str, Any]) -> Any:
    """``cls(**values)`` with nested dataclass fields rebuilt and lists made tuples."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        v = values[f.name]
        hint = hints.get(f.name)
        if dataclasses.is_dataclass(hint) and isinstance(v, Mapping):
            v = _build_dataclass(hint, v)
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[f.name] = v
    return cls(**kwargs)


def config_from_dict(name: str, data: Mapping[str, Any]) -> Any:
    """Rebuild a family config from ``dataclasses.asdict`` output (an export's ``config``)."""
    _require_supported(name, "<export>")
    from longboat.embodied.models.registry import model_class

    return _build_dataclass(model_class(name).config_class, data)
