"""SmolVLA in LeRobot's policy format (a ``lerobot/smolvla_base``-style directory).

A directory holds ``config.json`` (LeRobot's ``SmolVLAConfig`` fields, ``"type": "smolvla"``)
and ``model.safetensors`` with LeRobot's key names (``model.vlm_with_expert...``). The
backbone's shapes are not in ``config.json``: ``vlm_model_name`` names the SmolVLM2 model
whose ``config.json`` holds them (a local directory is read; the Hub name of
SmolVLM2-500M-Video-Instruct is known without one), ``num_vlm_layers`` how many of its text
layers are kept, ``expert_width_multiplier`` / ``self_attn_every_n_layers`` /
``attention_mode`` the action expert.

Two tensors of LeRobot's file cannot change the predicted actions and are not kept here: the
VLM's ``lm_head`` and the text model's final norm (only the prefix's output reads it).
Loading drops them; saving writes a copy of the token embeddings and a unit norm weight.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from longboat.core.config.errors import ConfigError
from longboat.embodied.models.common import lerobot_checkpoint as lrc
from longboat.embodied.models.common.lerobot_checkpoint import CONFIG_NAME, num_cameras
from longboat.embodied.models.common.lm import DecoderConfig
from longboat.embodied.models.common.vit import ViTConfig
from longboat.embodied.models.smolvla import config as smolvla_config
from longboat.embodied.models.smolvla.config import SMOLVLM2_500M, SmolVLAConfig, expert_for


def read_lerobot_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of a LeRobot SmolVLA directory (a ConfigError naming the problem)."""
    return lrc.read_policy_config(directory, "smolvla", "SmolVLA")


def read_vlm_config(name: str) -> dict[str, Any] | None:
    """The SmolVLM2 ``config.json`` that ``vlm_model_name`` names (None: the known Hub name
    of SmolVLM2-500M without a local copy)."""
    path = Path(name) / CONFIG_NAME
    if path.is_file():
        return json.loads(path.read_text())
    if name == SMOLVLM2_500M:
        return None
    raise ConfigError(
        f"vlm_model_name={name!r} is neither a local SmolVLM2 directory nor {SMOLVLM2_500M}",
        key="model.init_from",
        fix="set vlm_model_name in the policy's config.json to a directory holding the "
        "SmolVLM2 config.json",
    )


def backbone_from_vlm(
    vlm: dict[str, Any], num_vlm_layers: int
) -> tuple[ViTConfig, int, DecoderConfig]:
    """(vision tower, pixel-shuffle factor, text model kept) of a SmolVLM2 ``config.json``."""
    v, t = vlm.get("vision_config") or {}, vlm.get("text_config") or {}
    image, patch = int(v.get("image_size", 224)), int(v.get("patch_size", 32))
    vision = ViTConfig(
        hidden_size=int(v.get("hidden_size", 1152)),
        num_layers=int(v.get("num_hidden_layers", 12)),
        num_heads=int(v.get("num_attention_heads", 16)),
        intermediate_size=int(v.get("intermediate_size", 3072)),
        patch_size=patch,
        pos_grid=(image // patch, image // patch),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
    )
    heads = int(t["num_attention_heads"])
    layers = int(t["num_hidden_layers"])
    text = DecoderConfig(
        hidden_size=int(t["hidden_size"]),
        num_layers=num_vlm_layers if 0 < num_vlm_layers < layers else layers,
        num_heads=heads,
        num_kv_heads=int(t.get("num_key_value_heads") or heads),
        head_dim=int(t.get("head_dim") or int(t["hidden_size"]) // heads),
        intermediate_size=int(t["intermediate_size"]),
        vocab_size=int(t["vocab_size"]),
        rms_eps=float(t.get("rms_norm_eps", 1e-6)),
        style="qwen3",
    )
    return vision, int(vlm.get("scale_factor", 2)), text


def config_from_lerobot(lerobot_cfg: dict[str, Any]) -> SmolVLAConfig:
    """Our ``SmolVLAConfig`` for a LeRobot ``SmolVLAConfig`` dict (``config.json``). Fixed by
    LeRobot and so not read: the Beta's second parameter (1.0), scale / offset (0.999 /
    0.001), RoPE base 10000 (LeRobot's, whatever the SmolVLM2 config says)."""
    problems = []
    if lerobot_cfg.get("add_image_special_tokens"):
        problems.append("add_image_special_tokens=true is not supported")
    if int(lerobot_cfg.get("prefix_length", -1)) > 0:
        problems.append("prefix_length > 0 (a padded prefix) is not supported")
    if lerobot_cfg.get("adapt_to_pi_aloha"):
        problems.append("adapt_to_pi_aloha=true is not supported")
    n_vlm = int(lerobot_cfg.get("num_vlm_layers", 16))
    n_expert = int(lerobot_cfg.get("num_expert_layers", -1))
    if n_expert > 0 and n_expert != n_vlm:
        problems.append(
            f"num_expert_layers={n_expert} != num_vlm_layers={n_vlm}: one expert layer per "
            "text layer only"
        )
    mode = lerobot_cfg.get("attention_mode", "cross_attn")
    if mode not in ("cross_attn", "self_attn"):
        problems.append(f"attention_mode={mode!r} is not cross_attn or self_attn")
    if problems:
        raise ConfigError(
            "the LeRobot smolvla config cannot be built: " + "; ".join(problems),
            key="model.init_from",
        )
    vlm_name = str(lerobot_cfg.get("vlm_model_name", SMOLVLM2_500M))
    vision, scale, text = describe_backbone(vlm_name, n_vlm)
    side = vision.pos_grid[0] * vision.patch_size
    res = lerobot_cfg.get("resize_imgs_with_padding") or [side, side]
    if list(res) != [side, side]:
        raise ConfigError(
            f"resize_imgs_with_padding={res} differs from the vision tower's {side}x{side} "
            "images; longboat resizes frames to the tower's size",
            key="model.init_from",
        )
    return SmolVLAConfig(
        vision=vision,
        scale_factor=scale,
        text=text,
        expert=expert_for(text, float(lerobot_cfg.get("expert_width_multiplier", 0.75))),
        attention_mode=mode,
        self_attn_every_n_layers=int(lerobot_cfg.get("self_attn_every_n_layers", 2)),
        num_cameras=max(1, num_cameras(lerobot_cfg)),
        action_dim=int(lerobot_cfg.get("max_action_dim", 32)),
        max_state_dim=int(lerobot_cfg.get("max_state_dim", 32)),
        action_horizon=int(lerobot_cfg.get("chunk_size", 50)),
        max_token_len=int(lerobot_cfg.get("tokenizer_max_length", 48)),
        time_min_period=float(lerobot_cfg.get("min_period", 4e-3)),
        time_max_period=float(lerobot_cfg.get("max_period", 4.0)),
        num_inference_steps=int(lerobot_cfg.get("num_steps", 10)),
        tune_visual=not (
            lerobot_cfg.get("freeze_vision_encoder", True)
            or lerobot_cfg.get("train_expert_only", True)
        ),
        tune_llm=not lerobot_cfg.get("train_expert_only", True),
        tune_state_proj=bool(lerobot_cfg.get("train_state_proj", True)),
        frozen_dtype="float32",
        vlm_model_name=vlm_name,
    )


def describe_backbone(vlm_name: str, num_vlm_layers: int) -> tuple[ViTConfig, int, DecoderConfig]:
    """(vision tower, pixel-shuffle factor, text model kept) of the SmolVLM2 model
    ``vlm_name`` names, its first ``num_vlm_layers`` text layers kept (<= 0: all)."""
    vlm = read_vlm_config(vlm_name)
    if vlm is not None:
        return backbone_from_vlm(vlm, num_vlm_layers)
    full = smolvla_config.full()
    layers = num_vlm_layers if 0 < num_vlm_layers < 32 else 32
    return full.vision, full.scale_factor, dataclasses.replace(full.text, num_layers=layers)


def backbone_mismatch(cfg: SmolVLAConfig) -> str | None:
    """Why LeRobot would not rebuild ``cfg``'s backbone from ``cfg.vlm_model_name`` (None:
    it would)."""
    if cfg.vlm_model_name is None:
        return (
            "no SmolVLM2 model describes the backbone (vlm_model_name), and LeRobot builds it "
            "from that model's config.json: start from a LeRobot SmolVLA checkpoint or use "
            "the full flavor"
        )
    try:
        described = describe_backbone(cfg.vlm_model_name, cfg.text.num_layers)
    except ConfigError as err:
        return str(err)
    if described != (cfg.vision, cfg.scale_factor, cfg.text):
        return (
            f"the backbone is not the one vlm_model_name={cfg.vlm_model_name!r} describes, "
            "and LeRobot builds it from that model's config.json"
        )
    return None


# ---- key mapping -------------------------------------------------------------------------

_VLM = "model.vlm_with_expert.vlm."
VISION_PREFIX = _VLM + "model.vision_model."
TEXT_PREFIX = _VLM + "model.text_model."
EXPERT_PREFIX = "model.vlm_with_expert.lm_expert."
_UNUSED_HEAD = _VLM + "lm_head.weight"
_UNUSED_NORM = TEXT_PREFIX + "norm.weight"
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def renames(cfg: SmolVLAConfig) -> dict[str, str]:
    """Our key -> LeRobot key for every one-to-one tensor (the ViT's fused qkv aside)."""
    emb = VISION_PREFIX + "embeddings."
    m: dict[str, str] = {
        "vision.patch_embed.weight": emb + "patch_embedding.weight",
        "vision.patch_embed.bias": emb + "patch_embedding.bias",
        "vision.pos_embed": emb + "position_embedding.weight",
        "vision.post_layernorm.weight": VISION_PREFIX + "post_layernorm.weight",
        "vision.post_layernorm.bias": VISION_PREFIX + "post_layernorm.bias",
        "connector.weight": _VLM + "model.connector.modality_projection.proj.weight",
        "embed_tokens.weight": TEXT_PREFIX + "embed_tokens.weight",
        "expert_norm.weight": EXPERT_PREFIX + "norm.weight",
    }
    for name in (
        "state_proj",
        "action_in_proj",
        "action_out_proj",
        "action_time_mlp_in",
        "action_time_mlp_out",
    ):
        for p in ("weight", "bias"):
            m[f"{name}.{p}"] = f"model.{name}.{p}"
    for i in range(cfg.vision.num_layers):
        src, dst = f"vision.blocks.{i}.", f"{VISION_PREFIX}encoder.layers.{i}."
        for ours, theirs in (
            ("layer_norm1", "layer_norm1"),
            ("layer_norm2", "layer_norm2"),
            ("out_proj", "self_attn.out_proj"),
            ("fc1", "mlp.fc1"),
            ("fc2", "mlp.fc2"),
        ):
            for p in ("weight", "bias"):
                m[f"{src}{ours}.{p}"] = f"{dst}{theirs}.{p}"
    for i in range(cfg.text.num_layers):
        for ours, theirs in (
            ("lm", f"{TEXT_PREFIX}layers.{i}."),
            ("expert", f"{EXPERT_PREFIX}layers.{i}."),
        ):
            src = f"joint.layers.{i}.{ours}."
            for a in _ATTN:
                m[f"{src}{a}.weight"] = f"{theirs}self_attn.{a}.weight"
            for a in _MLP:
                m[f"{src}mlp.{a}.weight"] = f"{theirs}mlp.{a}.weight"
            m[f"{src}input_norm.weight"] = f"{theirs}input_layernorm.weight"
            m[f"{src}post_attention_norm.weight"] = f"{theirs}post_attention_layernorm.weight"
    return m


def qkv_keys(i: int) -> list[str]:
    """LeRobot's q / k / v projection names (no .weight/.bias) of vision layer ``i``."""
    return [f"{VISION_PREFIX}encoder.layers.{i}.self_attn.{n}_proj" for n in ("q", "k", "v")]


def to_lerobot_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """Our ``SmolVLA`` weights under LeRobot's names (plus the two tensors that cannot change
    actions: see the module docstring). Contiguous fp32 copies."""
    cfg: SmolVLAConfig = model.cfg
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    out = {dst: ours[src] for src, dst in renames(cfg).items()}
    lrc.split_vision_qkv(ours, out, cfg.vision.num_layers, qkv_keys)
    emb = ours["embed_tokens.weight"]
    out[_UNUSED_HEAD] = emb
    out[_UNUSED_NORM] = torch.ones(cfg.text.hidden_size, dtype=emb.dtype)
    return {k: v.to(torch.float32).contiguous().clone() for k, v in out.items()}


def expected_lerobot_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """LeRobot key -> shape a checkpoint must have for ``model`` (built on any device)."""
    cfg: SmolVLAConfig = model.cfg
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    out = {dst: shapes[src] for src, dst in renames(cfg).items()}
    d = cfg.vision.hidden_size
    for i in range(cfg.vision.num_layers):
        for key in qkv_keys(i):
            out[f"{key}.weight"], out[f"{key}.bias"] = (d, d), (d,)
    return out


def from_lerobot_state_dict(
    model: torch.nn.Module, state: dict[str, Any], *, source: str = "checkpoint"
) -> dict[str, Tensor]:
    """LeRobot-named ``state`` (tensors or shapes) -> our state dict for ``model``; a
    CheckpointError lists every missing, unexpected and mis-shaped key (LeRobot's names)
    before anything loads."""
    cfg: SmolVLAConfig = model.cfg
    want = expected_lerobot_shapes(model)
    optional = {_UNUSED_HEAD, _UNUSED_NORM}
    lrc.check_lerobot_state(
        want,
        state,
        optional=optional,
        source=source,
        what="smolvla as its config.json describes it",
        fix="use the config.json saved with these weights (vlm_model_name, "
        "num_vlm_layers, expert_width_multiplier, self_attn_every_n_layers, chunk_size, "
        "max_state_dim, max_action_dim)",
    )
    out = {src: state[dst] for src, dst in renames(cfg).items()}
    lrc.join_vision_qkv(state, out, cfg.vision.num_layers, qkv_keys)
    return out


# ---- directories -------------------------------------------------------------------------


def load_lerobot_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Copy ``directory/model.safetensors`` (LeRobot names) into ``model`` in place,
    keeping each parameter's dtype and device; mismatches raise before any copy."""
    lrc.load_lerobot_weights_with(model, directory, from_lerobot_state_dict)


def load_lerobot_smolvla(directory: str | Path, *, device: str | torch.device = "cpu"):
    """Build our ``SmolVLA`` from a LeRobot SmolVLA directory: (model, LeRobot config dict)."""
    from longboat.embodied.models.smolvla.model import SmolVLA

    lerobot_cfg = read_lerobot_config(directory)
    model = SmolVLA(config_from_lerobot(lerobot_cfg))
    load_lerobot_weights(model, directory)
    return model.to(device), lerobot_cfg


def lerobot_config_for(
    model: torch.nn.Module,
    *,
    state_dim: int,
    action_dim: int,
    camera_keys: list[str],
    base: dict[str, Any] | None = None,
    normalization: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A LeRobot ``SmolVLAConfig`` dict describing ``model``: ``base`` (the config.json the
    weights came from, if any) with the architecture and feature fields set from ``model``;
    ``vlm_model_name`` is the model config's (a ConfigError where it does not describe the
    backbone: ``backbone_mismatch``)."""
    cfg: SmolVLAConfig = model.cfg
    out = dict(base or {})
    why = backbone_mismatch(cfg)
    if why is not None:
        raise ConfigError(
            f"cannot be written in LeRobot's format: {why}",
            key="model.init_from",
            fix="start from a LeRobot SmolVLA checkpoint whose backbone the run keeps",
        )
    side = cfg.input_image_size()[0]
    visual, n_empty = lrc.camera_slots(camera_keys, cfg.num_cameras)
    multiplier = cfg.expert.hidden_size / cfg.text.hidden_size
    out.update(
        type="smolvla",
        n_obs_steps=1,
        chunk_size=cfg.action_horizon,
        n_action_steps=min(int(out.get("n_action_steps", cfg.action_horizon)), cfg.action_horizon),
        max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.action_dim,
        resize_imgs_with_padding=[side, side],
        empty_cameras=n_empty,
        tokenizer_max_length=cfg.max_token_len,
        num_steps=cfg.num_inference_steps,
        vlm_model_name=cfg.vlm_model_name,
        attention_mode=cfg.attention_mode,
        num_expert_layers=-1,
        num_vlm_layers=cfg.text.num_layers,
        self_attn_every_n_layers=cfg.self_attn_every_n_layers,
        expert_width_multiplier=out.get("expert_width_multiplier", multiplier),
        min_period=cfg.time_min_period,
        max_period=cfg.time_max_period,
        freeze_vision_encoder=not cfg.tune_visual,
        train_expert_only=not cfg.tune_llm,
        train_state_proj=cfg.tune_state_proj,
        input_features={
            **{k: {"type": "VISUAL", "shape": [3, side, side]} for k in visual},
            "observation.state": {"type": "STATE", "shape": [state_dim]},
        },
        output_features={"action": {"type": "ACTION", "shape": [action_dim]}},
    )
    if normalization is not None:
        out["normalization_mapping"] = dict(normalization)
    out.setdefault(
        "normalization_mapping", {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    )
    out.setdefault("device", "cpu")
    out.setdefault("use_amp", False)
    out.setdefault("load_vlm_weights", False)
    out.setdefault("add_image_special_tokens", False)
    out.setdefault("prefix_length", -1)
    return out


def save_lerobot_smolvla(
    model: torch.nn.Module, directory: str | Path, lerobot_cfg: dict[str, Any]
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (LeRobot's names) into ``directory``."""
    return lrc.save_lerobot_directory(to_lerobot_state_dict(model), directory, lerobot_cfg)
