"""``model.init_from=<Hugging Face backbone directory>``: load one part of a policy.

A directory written by transformers' ``save_pretrained`` (``config.json`` +
``model.safetensors`` or shards) whose ``model_type`` is one of the policy's
``BackboneAdapter.kinds`` loads only the parts it holds; every other weight keeps its
initialisation:

- pi05: ``paligemma`` (vision tower + projector + Gemma LM), ``siglip_vision_model`` or
  ``siglip`` (vision tower; a dual SiglipModel's text tower is read past), ``gemma``
  (the VLM's language model);
- groot_n1_6: ``siglip2_vision_model`` or ``siglip2`` (vision tower; SigLIP2's linear patch
  embedding, as the Isaac-GR00T release stores it), ``qwen3`` (the backbone LM and its
  final norm: layers at or above ``select_layer`` and the LM head are read past).

The architecture stays ``model.flavor`` + ``model.overrides``: a backbone does not describe
the whole policy. Its shape fields (``hidden_size``, ``num_key_value_heads``, ...; a field
config.json omits takes transformers' default) are checked against that config when the
config is resolved (one ConfigError naming every mismatching field), then its tensors' names
and shapes (one CheckpointError listing missing, unexpected and mis-shaped keys), both before
the dataset opens. The key maps are the families' own: a backbone's keys are renamed into
the LeRobot (pi05) or Isaac-GR00T (groot_n1_6) layout, whose names contain the HF ones.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from longboat.core.config.errors import ConfigError, ConfigProblem

# HF key prefixes of the parts of the backbones the policies read (their ``KINDS`` use them).
PALIGEMMA_PREFIXES = {
    "vision": (
        "model.vision_tower.vision_model.",
        "model.vision_tower.",
        "vision_tower.vision_model.",
        "vision_tower.",
    ),
    "projector": ("model.multi_modal_projector.", "multi_modal_projector."),
    "llm": (
        "model.language_model.model.",
        "model.language_model.",
        "language_model.model.",
        "language_model.",
    ),
}
VISION_ONLY = {"vision": ("vision_model.", "")}
DUAL_VISION = {"vision": ("vision_model.",)}
LM_ONLY = {"llm": ("model.", "")}
DUAL_IGNORED = ("text_model.", "logit_scale", "logit_bias")
NESTED_VISION = ("paligemma", "siglip", "siglip2")
"""``model_type``s whose vision settings sit under ``vision_config``."""


@dataclass(frozen=True)
class BackboneKind:
    """What one ``model_type`` holds and where its tensors are named (a policy's
    ``BackboneAdapter.kinds``)."""

    architecture: str
    """transformers' class name (for messages)."""
    prefixes: dict[str, tuple[str, ...]]
    """part ('vision', 'projector', 'llm') -> HF key prefixes of that part."""
    ignored: tuple[str, ...] = ()
    """HF key prefixes that belong to no part (read past)."""
    lm_style: str = "gemma"
    """The policy's language-model style (``gemma`` or ``qwen3``): the defaults of the LM
    config fields and the checks on them."""
    square_positions: bool = False
    """SigLIP2's position table (a square of ``num_patches``) instead of SigLIP's fixed
    ``(image_size / patch_size)^2``."""


PART_NAMES = {"vision": "vision tower", "projector": "projector", "llm": "language model"}

# transformers' defaults for the fields read here (older config.json files omit them).
_SIGLIP_DEFAULTS = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "patch_size": 16,
    "image_size": 224,
    "num_patches": 256,
    "layer_norm_eps": 1e-6,
    "num_channels": 3,
    "hidden_act": "gelu_pytorch_tanh",
}
_LM_DEFAULTS = {
    "gemma": {
        "hidden_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "intermediate_size": 24576,
        "vocab_size": 256000,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "gelu_pytorch_tanh",
    },
    "qwen3": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "intermediate_size": 22016,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
    },
}


@dataclass(frozen=True)
class BackboneDir:
    """A Hugging Face backbone directory, read: its kind and its part configs."""

    path: Path
    model_type: str
    kind: BackboneKind
    vision: dict[str, Any] | None
    """HF vision config (defaults filled) when it holds a vision tower."""
    text: dict[str, Any] | None
    """HF language-model config (defaults filled) when it holds an LM."""


def _read_raw(directory: str | Path) -> dict[str, Any] | None:
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return raw if isinstance(raw, dict) else None


def _kinds(family: str) -> dict[str, BackboneKind]:
    from longboat.embodied.models.registry import policy

    adapter = policy(family).backbones
    return dict(adapter.kinds) if adapter is not None else {}


def is_hf_backbone(directory: str | Path) -> bool:
    """Whether ``directory/config.json`` is a transformers backbone of a kind some policy
    initialises from (a LeRobot policy carries ``type``, an Isaac-GR00T one ``model_type``
    Gr00tN1d6)."""
    from longboat.embodied.models.registry import policy_names

    raw = _read_raw(directory)
    if raw is None or "type" in raw:
        return False
    return any(str(raw.get("model_type")) in _kinds(name) for name in policy_names())


def _filled(part: dict[str, Any] | None, defaults: dict[str, Any]) -> dict[str, Any]:
    part = dict(part or {})
    rope = part.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:  # transformers >= 5 nests it
        part.setdefault("rope_theta", rope["rope_theta"])
    if "hidden_activation" in part and part["hidden_activation"] is not None:
        part["hidden_act"] = part["hidden_activation"]  # Gemma's older spelling
    out = dict(defaults)
    out.update({k: v for k, v in part.items() if v is not None})
    return out


def read_backbone(directory: str | Path, family: str) -> BackboneDir:
    """Read a backbone directory for ``family`` (a ConfigError naming the model_type and
    the kinds that family takes otherwise)."""
    raw = _read_raw(directory) or {}
    model_type = raw.get("model_type")
    kinds = _kinds(family)
    kind = kinds.get(str(model_type))
    if kind is None:
        takes = ", ".join(f"{k.architecture} ({mt})" for mt, k in kinds.items()) or "nothing"
        raise ConfigError(
            f"{Path(directory) / 'config.json'} is a {model_type!r} model; {family} "
            f"initialises from {takes}",
            key="model.init_from",
            fix=f"use one of those directories, or a full {family} checkpoint",
        )
    vision = text = None
    if "vision" in kind.prefixes:
        sub = raw.get("vision_config") if model_type in NESTED_VISION else raw
        vision = _filled(sub, _SIGLIP_DEFAULTS)
    if "llm" in kind.prefixes:
        sub = raw.get("text_config") if model_type == "paligemma" else raw
        text = _filled(sub, _LM_DEFAULTS[kind.lm_style])
    return BackboneDir(Path(directory), str(model_type), kind, vision, text)


def _field_problems(
    where: str, hf: dict[str, Any], pairs: list[tuple[str, str, Any]]
) -> list[ConfigProblem]:
    out = []
    for hf_key, our_key, want in pairs:
        have = hf.get(hf_key)
        same = (
            math.isclose(float(have), float(want), rel_tol=1e-9)
            if isinstance(want, float) and isinstance(have, int | float)
            else have == want
        )
        if not same:
            out.append(
                ConfigProblem(
                    key="model.init_from",
                    message=f"{where}{hf_key}={have!r} but the model has {our_key}={want!r}",
                    fix=f"set model.overrides.{our_key}={have!r} (if the family supports it) "
                    "or use a backbone of the model's shape",
                )
            )
    return out


def check_backbone_config(backbone: BackboneDir, cfg: Any) -> None:
    """Every shape field of the backbone against the family config ``cfg`` (one ConfigError
    listing each mismatching field)."""
    problems: list[ConfigProblem] = []
    name = backbone.path / "config.json"
    nested = backbone.model_type in NESTED_VISION
    if backbone.vision is not None:
        v = cfg.vision
        gh, gw = v.pos_grid
        pairs = [
            ("hidden_size", "vision.hidden_size", v.hidden_size),
            ("num_hidden_layers", "vision.num_layers", v.num_layers),
            ("num_attention_heads", "vision.num_heads", v.num_heads),
            ("intermediate_size", "vision.intermediate_size", v.intermediate_size),
            ("patch_size", "vision.patch_size", v.patch_size),
            ("layer_norm_eps", "vision.layer_norm_eps", float(v.layer_norm_eps)),
            ("num_channels", "vision (RGB input)", 3),
            ("hidden_act", "vision (gelu-tanh MLP)", "gelu_pytorch_tanh"),
        ]
        if backbone.kind.square_positions:  # SigLIP2: a square table of num_patches
            pairs.append(("num_patches", "vision.pos_grid rows*cols", gh * gw))
            if gh != gw:
                problems.append(
                    ConfigProblem(
                        key="model.init_from",
                        message=f"SigLIP2's position table is square but vision.pos_grid="
                        f"{v.pos_grid!r}",
                        fix="set model.overrides.vision.pos_grid to a square grid",
                    )
                )
        else:  # SigLIP: a fixed (image_size / patch_size)^2 table
            side = gh * v.patch_size
            pairs.append(("image_size", "vision.pos_grid rows*patch_size", side))
            if gh != gw:
                pairs.append(("image_size", "vision.pos_grid cols*patch_size", gw * v.patch_size))
        problems += _field_problems(
            f"{name} {'vision_config.' if nested else ''}", backbone.vision, pairs
        )
    if backbone.text is not None:
        lm = cfg.llm
        style = backbone.kind.lm_style
        pairs = [
            ("hidden_size", "llm.hidden_size", lm.hidden_size),
            ("num_attention_heads", "llm.num_heads", lm.num_heads),
            ("num_key_value_heads", "llm.num_kv_heads", lm.num_kv_heads),
            ("head_dim", "llm.head_dim", lm.head_dim),
            ("intermediate_size", "llm.intermediate_size", lm.intermediate_size),
            ("vocab_size", "llm.vocab_size", lm.vocab_size),
            ("rms_norm_eps", "llm.rms_eps", float(lm.rms_eps)),
            ("rope_theta", "llm.rope_theta", float(lm.rope_theta)),
            (
                "hidden_act",
                f"llm.style ({style})",
                "gelu_pytorch_tanh" if style == "gemma" else "silu",
            ),
        ]
        if style == "gemma":
            pairs.append(("num_hidden_layers", "llm.num_layers", lm.num_layers))
        elif int(backbone.text["num_hidden_layers"]) < cfg.select_layer:
            pairs.append(("num_hidden_layers", "select_layer (at least)", cfg.select_layer))
        if lm.style != style or (style == "qwen3") != lm.qk_norm:
            problems.append(
                ConfigProblem(
                    key="model.init_from",
                    message=f"a {backbone.kind.architecture} needs llm.style={style!r} with "
                    f"qk_norm={style == 'qwen3'}, the model has {lm.style!r} / {lm.qk_norm}",
                )
            )
        where = f"{name} {'text_config.' if backbone.model_type == 'paligemma' else ''}"
        problems += _field_problems(where, backbone.text, pairs)
    if problems:
        raise ConfigError(problems)


def _part_of(kind: BackboneKind, key: str) -> tuple[str, str] | None:
    """(part, key relative to that part) of an HF key, or None."""
    for part, prefixes in kind.prefixes.items():
        for prefix in prefixes:
            if key.startswith(prefix):
                return part, key[len(prefix) :]
    return None


def to_reference_names(
    backbone: BackboneDir,
    state: dict[str, Tensor],
    targets: dict[str, str],
    want: dict[str, tuple[int, ...]],
    *,
    ignored: tuple[str, ...],
    fix: str,
) -> dict[str, Tensor]:
    """HF keys -> the family's reference layout (``targets``: part -> reference prefix),
    checked against ``want`` (reference key -> shape, filtered here to the parts held):
    one CheckpointError naming every missing, unexpected and mis-shaped key in the HF
    file's own names. Reference keys starting with ``ignored`` are read past."""
    from longboat.embodied.models.common.checkpoint_files import (
        mismatch_report,
        raise_on_mismatch,
    )

    out, stray, used = {}, [], {}
    for key, t in state.items():
        if key.startswith(backbone.kind.ignored):
            continue
        hit = _part_of(backbone.kind, key)
        if hit is None:
            stray.append(key)
            continue
        part, rest = hit
        used.setdefault(part, key[: len(key) - len(rest)])
        out[targets[part] + rest] = t
    held = tuple(targets.values())
    want = {k: s for k, s in want.items() if k.startswith(held)}
    missing, unexpected, misshaped = mismatch_report(want, out, ignored=ignored)

    def hf_name(ref: str) -> str:
        for part, prefix in targets.items():
            if ref.startswith(prefix):
                hf_prefix = used.get(part, backbone.kind.prefixes[part][-1])
                return hf_prefix + ref[len(prefix) :]
        return ref

    raise_on_mismatch(
        str(backbone.path),
        f"the {' + '.join(PART_NAMES[p] for p in targets)} of the model",
        (
            [hf_name(k) for k in missing],
            sorted(stray + [hf_name(k) for k in unexpected]),
            [hf_name(k) for k in misshaped],
        ),
        fix,
    )
    return out


def summary_line(backbone: BackboneDir, loaded: int, initialised: list[str]) -> str:
    """The one line a run prints: which parts came from where and which stay initialised."""
    parts = " + ".join(PART_NAMES[p] for p in backbone.kind.prefixes)
    return (
        f"model.init_from: loaded {parts} ({loaded} tensors) from "
        f"{backbone.kind.architecture} {backbone.path}; initialised: {', '.join(initialised)}"
    )


def top_modules(keys: list[str], depth_of: dict[str, int]) -> list[str]:
    """Distinct module names of ``keys`` (a prefix listed in ``depth_of`` is cut at that
    many dots, everything else at the first)."""
    seen: dict[str, None] = {}
    for k in keys:
        parts = k.split(".")
        depth = next((d for p, d in depth_of.items() if k.startswith(p)), 1)
        seen[".".join(parts[:depth])] = None
    return list(seen)


def load_part(model: torch.nn.Module, ours: dict[str, Tensor]) -> list[str]:
    """Copy ``ours`` into ``model`` (dtypes and devices of ``model`` kept); the keys of
    ``model`` left at their initialisation."""
    result = model.load_state_dict(ours, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    return list(result.missing_keys)
