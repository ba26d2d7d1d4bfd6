"""``model.init_from``: start a run from released weights (the policy's
``CheckpointAdapter``: pi0.5 in LeRobot's policy format, GR00T N1.6 in the Isaac-GR00T
release layout), or from a Hugging Face backbone alone (``hf_backbones`` with the policy's
``BackboneAdapter``: PaliGemma / SigLIP / Gemma for pi0.5, SigLIP2 / Qwen3 for GR00T; the
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
from typing import Any

from torch import nn

from longboat.core.config.errors import ConfigError
from longboat.embodied.models import hf_backbones
from longboat.embodied.models.family import PolicyFamily
from longboat.embodied.models.registry import (
    build_model,
    find_policy,
    get_config,
    policy,
    policy_names,
)


def _supporting(name: str, init_from: str, what: str) -> PolicyFamily:
    """The policy ``name`` when it reads ``what`` (``checkpoints`` or ``backbones``), else a
    ConfigError naming the policies that do."""
    family = find_policy(name)
    if family is None or getattr(family, what) is None:
        # Reverse name order: the order this message has always listed them in.
        readers = sorted(
            (n for n in policy_names() if getattr(find_policy(n), what) is not None),
            reverse=True,
        )
        kind = "checkpoints" if what == "checkpoints" else "Hugging Face backbones"
        raise ConfigError(
            f"reads {kind} of {', '.join(readers) or 'no policy'} only, not model.name={name!r}",
            key="model.init_from",
            value=init_from,
            fix="set model.name to one of those, or model.init_from=null",
        )
    return family


def resolve_model_config(
    name: str, flavor: str, overrides: Mapping[str, Any], init_from: str | None
) -> Any:
    """The family config of a run: ``name``/``flavor`` + ``overrides``, or with
    ``init_from`` the checkpoint's architecture + ``overrides``, its weights checked."""
    if not init_from:
        return get_config(name, flavor, overrides)
    if hf_backbones.is_hf_backbone(init_from):
        adapter = _supporting(name, init_from, "backbones").backbones
        assert adapter is not None
        backbone = hf_backbones.read_backbone(init_from, name)
        cfg = get_config(name, flavor, overrides)
        hf_backbones.check_backbone_config(backbone, cfg)
        from longboat.embodied.models.common.checkpoint_files import read_shapes

        adapter.backbone_state(
            build_model(name, cfg, device="meta"), backbone, read_shapes(init_from)
        )
        return cfg
    checkpoints = _supporting(name, init_from, "checkpoints").checkpoints
    assert checkpoints is not None
    return checkpoints.resolve_config(overrides, init_from)


def load_initial_weights(model: nn.Module, name: str, init_from: str) -> str | None:
    """Copy the ``init_from`` checkpoint into ``model`` (built from ``resolve_model_config``);
    for a Hugging Face backbone, the one line saying what was loaded and what stays
    initialised (None for a full checkpoint)."""
    if hf_backbones.is_hf_backbone(init_from):
        adapter = _supporting(name, init_from, "backbones").backbones
        assert adapter is not None
        from longboat.embodied.models.common.checkpoint_files import read_tensors

        backbone = hf_backbones.read_backbone(init_from, name)
        hf_backbones.check_backbone_config(backbone, model.cfg)
        ours = adapter.backbone_state(model, backbone, read_tensors(init_from))
        left = hf_backbones.load_part(model, ours)
        return hf_backbones.summary_line(backbone, len(ours), adapter.initialised_parts(left))
    checkpoints = _supporting(name, init_from, "checkpoints").checkpoints
    assert checkpoints is not None
    checkpoints.load_weights(model, init_from)
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
    return _build_dataclass(policy(name).config_class, data)
