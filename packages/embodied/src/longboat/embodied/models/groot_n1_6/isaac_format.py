"""GR00T N1.6 in NVIDIA's release layout (an Isaac-GR00T ``Gr00tN1d6`` checkpoint directory).

A directory holds ``config.json`` (``Gr00tN1d6Config`` fields, ``"model_type": "Gr00tN1d6"``)
and ``model.safetensors`` or shards listed in ``model.safetensors.index.json``, with
Isaac-GR00T's key names (``backbone.model.vision_model...``, ``backbone.model.mlp1...``,
``backbone.model.language_model.model.layers...``, ``action_head...``; ``weight_names``).

The architecture comes from the config: ``model_name`` names the Eagle backbone
(``EAGLE_VARIANTS``: the SigLIP2 tower, the Qwen3 shapes, the image token), ``select_layer``
how many Qwen3 layers are kept, ``diffusion_model_cfg`` the DiT, and ``max_state_dim``,
``max_action_dim``, ``action_horizon``, ``hidden_size``, ``input_embedding_dim``,
``max_seq_len``, ``max_num_embodiments``, the flow-matching fields, ``shortest_image_edge``
and ``crop_fraction`` the rest. ``load_bf16`` keeps frozen weights bf16 (as Isaac-GR00T
loads them), trainable ones fp32.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from longboat.core.config.errors import ConfigError
from longboat.embodied.models.common.checkpoint_files import (
    WEIGHTS_NAME,
    read_shapes,
    read_tensors,
)
from longboat.embodied.models.common.dit import DiTConfig
from longboat.embodied.models.groot_n1_6 import config as groot_config
from longboat.embodied.models.groot_n1_6.config import GrootN16Config
from longboat.embodied.models.groot_n1_6.weight_names import from_isaac, to_isaac

CONFIG_NAME = "config.json"
MODEL_TYPE = "Gr00tN1d6"

EAGLE_VARIANTS = {
    "nvidia/Eagle-Block2A-2B-v2": groot_config.full,
    "longboat/eagle-tiny": groot_config.tiny,
}
"""Backbone by Isaac-GR00T's ``model_name``: the flavor whose vision tower, Qwen3 shapes,
image token id and unshuffle factor it has. ``nvidia/Eagle-Block2A-2B-v2`` is the N1.6
release's; ``longboat/eagle-tiny`` is our tiny flavor's (tests)."""


def read_json_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory (a ConfigError naming the problem)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist",
            key="model.init_from",
            value=str(directory),
            fix="point model.init_from at a checkpoint directory (config.json + model.safetensors)",
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err})", key="model.init_from") from err
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path} holds a {type(raw).__name__}, not an object", key="model.init_from"
        )
    return raw


def _get(raw: dict[str, Any], key: str, default: Any) -> Any:
    value = raw.get(key, default)
    return default if value is None else value


def config_from_isaac(raw: dict[str, Any]) -> GrootN16Config:
    """Our ``GrootN16Config`` for an Isaac-GR00T ``Gr00tN1d6Config`` dict (``config.json``)."""
    problems = []
    name = raw.get("model_name", "nvidia/Eagle-Block2A-2B-v2")
    if name not in EAGLE_VARIANTS:
        problems.append(f"model_name={name!r} is not one of {sorted(EAGLE_VARIANTS)}")
    dit = dict(raw.get("diffusion_model_cfg") or {})
    required = {
        "use_alternate_vl_dit": True,
        "add_pos_embed": True,
        "use_vlln": True,
        "apply_sincos_state_encoding": False,
        "use_relative_action": False,
    }
    for key, want in required.items():
        if bool(raw.get(key, want)) != want:
            problems.append(f"{key}={raw[key]!r} is not supported (only {want})")
    for key, want in (("norm_type", "ada_norm"), ("interleave_self_attention", True)):
        if dit.get(key, want) != want:
            problems.append(
                f"diffusion_model_cfg.{key}={dit[key]!r} is not supported (only {want!r})"
            )
    if dit.get("positional_embeddings") is not None:
        problems.append("diffusion_model_cfg.positional_embeddings must be null")
    if float(_get(raw, "noise_beta_beta", 1.0)) != 1.0:
        problems.append(f"noise_beta_beta={raw['noise_beta_beta']!r} is not supported (only 1.0)")
    if float(_get(raw, "state_additive_noise_scale", 0.0)) != 0.0:
        problems.append("state_additive_noise_scale > 0 is not supported")
    for key in ("image_crop_size", "image_target_size"):
        if raw.get(key) is not None:
            problems.append(f"{key}={raw[key]!r} is not supported (use shortest_image_edge)")
    heads = int(_get(dit, "num_attention_heads", 32))
    head_dim = int(_get(dit, "attention_head_dim", 48))
    hidden = int(_get(raw, "hidden_size", 1024))
    if int(_get(raw, "input_embedding_dim", heads * head_dim)) != heads * head_dim:
        problems.append(
            f"input_embedding_dim={raw['input_embedding_dim']} != num_attention_heads * "
            f"attention_head_dim = {heads * head_dim}"
        )
    if int(_get(dit, "output_dim", hidden)) != hidden:
        problems.append(
            f"diffusion_model_cfg.output_dim={dit['output_dim']} != hidden_size={hidden} "
            "(the action decoder reads the DiT output at hidden_size)"
        )
    base = EAGLE_VARIANTS[name]() if name in EAGLE_VARIANTS else None
    width = int(_get(raw, "backbone_embedding_dim", base.llm.hidden_size if base else 0))
    if base is not None and width != base.llm.hidden_size:
        problems.append(
            f"backbone_embedding_dim={width} != the {name} language model's width "
            f"{base.llm.hidden_size}"
        )
    if problems:
        raise ConfigError(
            "the Isaac-GR00T N1.6 config cannot be built: " + "; ".join(problems),
            key="model.init_from",
        )
    assert base is not None
    patch = base.vision.patch_size * base.pixel_unshuffle
    crop = raw.get("crop_fraction", 0.95)
    image = dataclasses.replace(
        base.image,
        resize_shortest=raw.get("shortest_image_edge", base.image.resize_shortest),
        crop_fraction=1.0 if crop is None else float(crop),
        multiple_of=patch,
    )
    return GrootN16Config(
        vision=base.vision,
        llm=base.llm,
        dit=DiTConfig(
            num_layers=int(_get(dit, "num_layers", 32)),
            num_heads=heads,
            head_dim=head_dim,
            cross_attention_dim=width,
            output_dim=hidden,
            dropout=float(_get(dit, "dropout", 0.2)),
            attend_text_every_n_blocks=int(_get(raw, "attend_text_every_n_blocks", 2)),
        ),
        image=image,
        select_layer=int(_get(raw, "select_layer", 16)),
        image_token_id=base.image_token_id,
        pixel_unshuffle=base.pixel_unshuffle,
        num_embodiments=int(_get(raw, "max_num_embodiments", 32)),
        max_state_dim=int(_get(raw, "max_state_dim", 29)),
        max_action_dim=int(_get(raw, "max_action_dim", 29)),
        action_horizon=int(_get(raw, "action_horizon", 16)),
        state_hidden=hidden,
        action_decoder_hidden=hidden,
        max_seq_len=int(_get(raw, "max_seq_len", 1024)),
        num_timestep_buckets=int(_get(raw, "num_timestep_buckets", 1000)),
        num_inference_steps=int(_get(raw, "num_inference_timesteps", 4)),
        noise_beta_alpha=float(_get(raw, "noise_beta_alpha", 1.5)),
        noise_s=float(_get(raw, "noise_s", 0.999)),
        state_dropout_prob=float(_get(raw, "state_dropout_prob", 0.0)),
        tune_visual=bool(raw.get("tune_visual", False)),
        tune_llm=bool(raw.get("tune_llm", False)),
        tune_top_llm_layers=int(_get(raw, "tune_top_llm_layers", 4)),
        frozen_dtype="bfloat16" if raw.get("load_bf16", True) else "float32",
    )


def isaac_config_for(model: torch.nn.Module, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An Isaac-GR00T ``Gr00tN1d6Config`` dict describing ``model``: ``base`` (the
    config.json the weights came from, if any) with every architecture field set."""
    cfg: GrootN16Config = model.cfg
    name = next(
        (
            n
            for n, flavor in EAGLE_VARIANTS.items()
            if (flavor().vision, flavor().llm, flavor().image_token_id)
            == (cfg.vision, cfg.llm, cfg.image_token_id)
        ),
        None,
    )
    if name is None:
        raise ConfigError(
            "this backbone (vision / llm shapes) is no Eagle variant Isaac-GR00T names; "
            f"known: {sorted(EAGLE_VARIANTS)}",
            key="model.overrides",
        )
    if not cfg.state_hidden == cfg.action_decoder_hidden == cfg.dit.output_dim:
        raise ConfigError(
            f"state_hidden={cfg.state_hidden}, action_decoder_hidden={cfg.action_decoder_hidden} "
            f"and dit.output_dim={cfg.dit.output_dim} must be equal (Isaac-GR00T's hidden_size)",
            key="model.overrides",
        )
    out = dict(base or {})
    out.update(
        model_type=MODEL_TYPE,
        model_name=name,
        backbone_model_type="eagle",
        select_layer=cfg.select_layer,
        backbone_embedding_dim=cfg.llm.hidden_size,
        max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.max_action_dim,
        action_horizon=cfg.action_horizon,
        hidden_size=cfg.state_hidden,
        input_embedding_dim=cfg.dit.inner_dim,
        add_pos_embed=True,
        use_vlln=True,
        max_seq_len=cfg.max_seq_len,
        use_alternate_vl_dit=True,
        attend_text_every_n_blocks=cfg.dit.attend_text_every_n_blocks,
        diffusion_model_cfg={
            "positional_embeddings": None,
            "num_layers": cfg.dit.num_layers,
            "num_attention_heads": cfg.dit.num_heads,
            "attention_head_dim": cfg.dit.head_dim,
            "norm_type": "ada_norm",
            "dropout": cfg.dit.dropout,
            "final_dropout": True,
            "output_dim": cfg.dit.output_dim,
            "interleave_self_attention": True,
        },
        num_inference_timesteps=cfg.num_inference_steps,
        noise_beta_alpha=cfg.noise_beta_alpha,
        noise_beta_beta=1.0,
        noise_s=cfg.noise_s,
        num_timestep_buckets=cfg.num_timestep_buckets,
        state_dropout_prob=cfg.state_dropout_prob,
        max_num_embodiments=cfg.num_embodiments,
        shortest_image_edge=cfg.image.resize_shortest,
        crop_fraction=cfg.image.crop_fraction,
        tune_visual=cfg.tune_visual,
        tune_llm=cfg.tune_llm,
        tune_top_llm_layers=cfg.tune_top_llm_layers,
        load_bf16=cfg.frozen_dtype == "bfloat16",
    )
    return out


def read_isaac_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of an Isaac-GR00T N1.6 directory (model_type checked)."""
    raw = read_json_config(directory)
    if raw.get("model_type") != MODEL_TYPE:
        raise ConfigError(
            f"{Path(directory) / CONFIG_NAME} has model_type={raw.get('model_type')!r}, not "
            f"{MODEL_TYPE!r}",
            key="model.init_from",
            fix="use an Isaac-GR00T N1.6 checkpoint (config.json with model_type Gr00tN1d6)",
        )
    return raw


def check_isaac_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Names and shapes of ``directory``'s weights against ``model`` (meta is enough)."""
    from_isaac(model, read_shapes(directory), source=str(directory))


def load_isaac_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Copy an Isaac-GR00T N1.6 checkpoint into ``model`` in place (dtypes and devices of
    ``model`` kept); mismatches raise before any copy."""
    ours = from_isaac(model, read_tensors(directory), source=str(directory))
    result = model.load_state_dict(ours, strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def load_isaac_groot(directory: str | Path, *, device: str | torch.device = "cpu"):
    """Build our ``GrootN16`` from an Isaac-GR00T N1.6 directory: (model, config dict)."""
    from longboat.embodied.models.groot_n1_6.model import GrootN16

    raw = read_isaac_config(directory)
    model = GrootN16(config_from_isaac(raw))
    load_isaac_weights(model, directory)
    return model.to(device), raw


def save_isaac_groot(
    model: torch.nn.Module, directory: str | Path, isaac_cfg: dict[str, Any]
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (Isaac-GR00T's names) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(to_isaac(model), str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    (directory / CONFIG_NAME).write_text(json.dumps(isaac_cfg, indent=2) + "\n")
    return directory
