"""pi0.5 in LeRobot's policy format (a ``lerobot/pi05_base``-style directory).

A directory holds ``config.json`` (LeRobot's ``PI05Config`` fields, ``"type": "pi05"``)
and ``model.safetensors`` with LeRobot's key names (``model.paligemma_with_expert...``).
The architecture comes from the config: ``paligemma_variant`` / ``action_expert_variant``
name the Gemma shapes (``GEMMA_VARIANTS``), ``image_resolution`` the square frame side,
``chunk_size``, ``max_state_dim``, ``max_action_dim``, ``tokenizer_max_length``,
``num_inference_steps``, the time-sampling Beta and the sin-cos periods the rest.

Our ``Pi05`` holds the same weights under other names; ``to_lerobot_state_dict`` and
``from_lerobot_state_dict`` map them. LeRobot's file has three tensors that cannot change
the predicted actions and that ``Pi05`` does not keep: the VLM's ``lm_head`` (a copy of
the token embeddings), the VLM's final norm (only the prefix output reads it) and the
action expert's ``lm_head`` (never called). Loading drops them; saving writes the
embedding copy, a zero norm weight (Gemma's identity) and a zero expert head.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from longboat.core.config.errors import ConfigError
from longboat.embodied.models.common import lerobot_checkpoint as lrc
from longboat.embodied.models.common.image_preprocessing import ImagePreprocessConfig
from longboat.embodied.models.common.lerobot_checkpoint import num_cameras
from longboat.embodied.models.common.lm import DecoderConfig
from longboat.embodied.models.common.vit import ViTConfig, siglip_so400m
from longboat.embodied.models.pi05 import config as pi05_config
from longboat.embodied.models.pi05.config import Pi05Config

# Gemma shapes by LeRobot's variant name: (width, depth, mlp_dim, heads, kv_heads, head_dim).
# gemma_2b / gemma_300m are LeRobot's (openpi's); the longboat_tiny_* pair is our tiny
# flavor, which LeRobot builds only with the variant table patched (the parity test does).
GEMMA_VARIANTS: dict[str, tuple[int, int, int, int, int, int]] = {
    "gemma_2b": (2048, 18, 16384, 8, 1, 256),
    "gemma_300m": (1024, 18, 4096, 8, 1, 256),
    "longboat_tiny_vlm": (64, 4, 128, 8, 1, 16),
    "longboat_tiny_expert": (32, 4, 64, 8, 1, 16),
}
FULL_VOCAB = 257152
"""PaliGemma's vocabulary (LeRobot fixes it)."""
TINY_VOCAB = 1024


def _tiny_vision() -> ViTConfig:
    """The tiny flavor's vision tower."""
    return pi05_config.tiny().vision


def _decoder(variant: str, vocab: int) -> DecoderConfig:
    w, depth, mlp, heads, kv, hd = GEMMA_VARIANTS[variant]
    return DecoderConfig(
        hidden_size=w,
        num_layers=depth,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hd,
        intermediate_size=mlp,
        vocab_size=vocab,
        style="gemma",
    )


def read_lerobot_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of a LeRobot policy directory (a ConfigError naming the problem)."""
    return lrc.read_policy_config(directory, "pi05", "pi0.5")


def config_from_lerobot(lerobot_cfg: dict[str, Any]) -> Pi05Config:
    """Our ``Pi05Config`` for a LeRobot ``PI05Config`` dict (``config.json``).

    Fixed by LeRobot's format and so not read: the SigLIP So400m/14 tower, the PaliGemma
    vocabulary, the Beta's second parameter (1.0) and scale/offset (0.999 / 0.001). The
    model applies no crop augmentation (LeRobot's pi0.5 does none inside the policy)."""
    problems = []
    for key in ("paligemma_variant", "action_expert_variant"):
        v = lerobot_cfg.get(key)
        if v not in GEMMA_VARIANTS:
            problems.append(f"{key}={v!r} is not one of {sorted(GEMMA_VARIANTS)}")
    res = lerobot_cfg.get("image_resolution", [224, 224])
    if not (isinstance(res, list | tuple) and len(res) == 2 and res[0] == res[1]):
        problems.append(f"image_resolution={res!r} must be a square [side, side]")
    fixed = {
        "time_sampling_beta_beta": 1.0,
        "time_sampling_scale": 0.999,
        "time_sampling_offset": 0.001,
    }
    for key, want in fixed.items():
        if float(lerobot_cfg.get(key, want)) != want:
            problems.append(f"{key}={lerobot_cfg[key]!r} is not supported (only {want})")
    if lerobot_cfg.get("use_relative_actions"):
        problems.append("use_relative_actions=true is not supported (absolute actions only)")
    if lerobot_cfg.get("max_state_dim") != lerobot_cfg.get("max_action_dim"):
        problems.append(
            f"max_state_dim={lerobot_cfg.get('max_state_dim')} != max_action_dim="
            f"{lerobot_cfg.get('max_action_dim')}: our pi05 pads both to one width"
        )
    if problems:
        raise ConfigError(
            "the LeRobot pi05 config cannot be built: " + "; ".join(problems),
            key="model.init_from",
        )
    side = int(res[0])
    tiny = lerobot_cfg["paligemma_variant"].startswith("longboat_tiny")
    vocab = TINY_VOCAB if tiny else FULL_VOCAB
    patch = 14
    grid = side // patch
    vision = _tiny_vision() if tiny else siglip_so400m(pos_grid=(grid, grid))
    vision = dataclasses.replace(vision, pos_grid=(grid, grid))
    horizon = int(lerobot_cfg.get("chunk_size", 50))
    max_dim = int(lerobot_cfg.get("max_action_dim", 32))
    return Pi05Config(
        vision=vision,
        llm=_decoder(lerobot_cfg["paligemma_variant"], vocab),
        expert=_decoder(lerobot_cfg["action_expert_variant"], 0),
        image=ImagePreprocessConfig(pad_to_square=side, crop_fraction=1.0, multiple_of=patch),
        num_cameras=max(1, num_cameras(lerobot_cfg)),
        action_dim=max_dim,
        max_state_dim=max_dim,
        action_horizon=horizon,
        max_token_len=int(lerobot_cfg.get("tokenizer_max_length", 200)) + max_dim,
        time_min_period=float(lerobot_cfg.get("min_period", 4e-3)),
        time_max_period=float(lerobot_cfg.get("max_period", 4.0)),
        num_inference_steps=int(lerobot_cfg.get("num_inference_steps", 10)),
        noise_beta_alpha=float(lerobot_cfg.get("time_sampling_beta_alpha", 1.5)),
        frozen_dtype="float32",
        state_in_prompt=True,  # LeRobot's preprocessor spells the state in the prompt
    )


# ---- key mapping -------------------------------------------------------------------------

PALIGEMMA_PREFIX = "model.paligemma_with_expert.paligemma.model."
VISION_PREFIX = PALIGEMMA_PREFIX + "vision_tower.vision_model."
LM_PREFIX = PALIGEMMA_PREFIX + "language_model."
_EX = "model.paligemma_with_expert.gemma_expert."
_UNUSED_VLM_HEAD = "model.paligemma_with_expert.paligemma.lm_head.weight"
_UNUSED_VLM_NORM = LM_PREFIX + "norm.weight"
_UNUSED_EXPERT_HEAD = _EX + "lm_head.weight"


def renames(cfg: Pi05Config) -> dict[str, str]:
    """Our key -> LeRobot key for every one-to-one tensor (the ViT's fused qkv aside)."""
    m: dict[str, str] = {
        "vision.patch_embed.weight": VISION_PREFIX + "embeddings.patch_embedding.weight",
        "vision.patch_embed.bias": VISION_PREFIX + "embeddings.patch_embedding.bias",
        "vision.pos_embed": VISION_PREFIX + "embeddings.position_embedding.weight",
        "vision.post_layernorm.weight": VISION_PREFIX + "post_layernorm.weight",
        "vision.post_layernorm.bias": VISION_PREFIX + "post_layernorm.bias",
        "projector.weight": PALIGEMMA_PREFIX + "multi_modal_projector.linear.weight",
        "projector.bias": PALIGEMMA_PREFIX + "multi_modal_projector.linear.bias",
        "embed_tokens.weight": LM_PREFIX + "embed_tokens.weight",
        "expert_norm.modulation.weight": _EX + "model.norm.dense.weight",
        "expert_norm.modulation.bias": _EX + "model.norm.dense.bias",
    }
    for name in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"):
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
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp = ("gate_proj", "up_proj", "down_proj")
    for i in range(cfg.llm.num_layers):
        lm, lm_t = f"joint.layers.{i}.lm.", f"{LM_PREFIX}layers.{i}."
        ex, ex_t = f"joint.layers.{i}.expert.", f"{_EX}model.layers.{i}."
        for a in attn:
            m[f"{lm}{a}.weight"] = f"{lm_t}self_attn.{a}.weight"
            m[f"{ex}{a}.weight"] = f"{ex_t}self_attn.{a}.weight"
        for a in mlp:
            m[f"{lm}mlp.{a}.weight"] = f"{lm_t}mlp.{a}.weight"
            m[f"{ex}mlp.{a}.weight"] = f"{ex_t}mlp.{a}.weight"
        m[f"{lm}input_norm.weight"] = f"{lm_t}input_layernorm.weight"
        m[f"{lm}post_attention_norm.weight"] = f"{lm_t}post_attention_layernorm.weight"
        for norm, theirs in (
            ("input_norm", "input_layernorm"),
            ("post_attention_norm", "post_attention_layernorm"),
        ):
            for p in ("weight", "bias"):
                m[f"{ex}{norm}.modulation.{p}"] = f"{ex_t}{theirs}.dense.{p}"
    return m


def qkv_keys(i: int) -> list[str]:
    """LeRobot's q / k / v projection names (no .weight/.bias) of vision layer ``i``."""
    return [f"{VISION_PREFIX}encoder.layers.{i}.self_attn.{n}_proj" for n in ("q", "k", "v")]


def to_lerobot_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """Our ``Pi05`` weights under LeRobot's names (plus the three tensors LeRobot keeps
    that cannot change actions: see the module docstring). Contiguous fp32 copies."""
    cfg: Pi05Config = model.cfg
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    out: dict[str, Tensor] = {}
    for src, dst in renames(cfg).items():
        out[dst] = ours[src]
    lrc.split_vision_qkv(ours, out, cfg.vision.num_layers, qkv_keys)
    emb = ours["embed_tokens.weight"]
    out[_UNUSED_VLM_HEAD] = emb
    out[_UNUSED_VLM_NORM] = torch.zeros(cfg.llm.hidden_size, dtype=emb.dtype)
    out[_UNUSED_EXPERT_HEAD] = torch.zeros(FULL_VOCAB, cfg.expert.hidden_size, dtype=emb.dtype)
    return {k: v.to(torch.float32).contiguous().clone() for k, v in out.items()}


def expected_lerobot_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """LeRobot key -> shape a checkpoint must have for ``model`` (built on any device)."""
    cfg: Pi05Config = model.cfg
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    out = {dst: shapes[src] for src, dst in renames(cfg).items()}
    for i in range(cfg.vision.num_layers):
        d = cfg.vision.hidden_size
        for key in qkv_keys(i):
            out[f"{key}.weight"], out[f"{key}.bias"] = (d, d), (d,)
    return out


def from_lerobot_state_dict(
    model: torch.nn.Module, state: dict[str, Tensor], *, source: str = "checkpoint"
) -> dict[str, Tensor]:
    """LeRobot-named ``state`` -> our state dict for ``model``; a CheckpointError lists
    every missing, unexpected and mis-shaped key (LeRobot's names) before anything loads."""
    cfg: Pi05Config = model.cfg
    want = expected_lerobot_shapes(model)
    optional = {_UNUSED_VLM_HEAD, _UNUSED_VLM_NORM, _UNUSED_EXPERT_HEAD}
    lrc.check_lerobot_state(
        want,
        state,
        optional=optional,
        source=source,
        what="pi05 as its config.json describes it",
        fix="use the config.json saved with these weights (paligemma_variant, "
        "action_expert_variant, image_resolution, chunk_size, max_action_dim)",
    )
    out = {src: state[dst] for src, dst in renames(cfg).items()}
    lrc.join_vision_qkv(state, out, cfg.vision.num_layers, qkv_keys)
    return out


# ---- directories -------------------------------------------------------------------------


def load_lerobot_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Copy ``directory/model.safetensors`` (LeRobot names) into ``model`` in place,
    keeping each parameter's dtype and device; mismatches raise before any copy."""
    lrc.load_lerobot_weights_with(model, directory, from_lerobot_state_dict)


def load_lerobot_pi05(directory: str | Path, *, device: str | torch.device = "cpu"):
    """Build our ``Pi05`` from a LeRobot pi0.5 directory: (model, LeRobot config dict)."""
    from longboat.embodied.models.pi05.model import Pi05

    lerobot_cfg = read_lerobot_config(directory)
    model = Pi05(config_from_lerobot(lerobot_cfg))
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
    """A LeRobot ``PI05Config`` dict describing ``model``: ``base`` (the config.json the
    weights came from, if any) with the architecture and feature fields set from ``model``;
    ``normalization`` sets ``normalization_mapping`` (default: ``base``'s, else LeRobot's
    pi0.5 default, quantiles for state and action)."""
    cfg: Pi05Config = model.cfg
    by_shape = {v: k for k, v in GEMMA_VARIANTS.items()}

    def variant(d: DecoderConfig) -> str:
        key = (
            d.hidden_size,
            d.num_layers,
            d.intermediate_size,
            d.num_heads,
            d.num_kv_heads,
            d.head_dim,
        )
        if key not in by_shape:
            raise ConfigError(
                f"a Gemma of shape {key} has no LeRobot variant name; LeRobot builds only "
                f"{sorted(GEMMA_VARIANTS)}",
                key="model.overrides",
            )
        return by_shape[key]

    side = cfg.input_image_size()[0]
    visual, n_empty = lrc.camera_slots(camera_keys, cfg.num_cameras)
    out = dict(base or {})
    out.update(
        type="pi05",
        n_obs_steps=1,
        paligemma_variant=variant(cfg.llm),
        action_expert_variant=variant(cfg.expert),
        dtype="float32",
        chunk_size=cfg.action_horizon,
        n_action_steps=min(int(out.get("n_action_steps", cfg.action_horizon)), cfg.action_horizon),
        max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.action_dim,
        num_inference_steps=cfg.num_inference_steps,
        time_sampling_beta_alpha=cfg.noise_beta_alpha,
        time_sampling_beta_beta=1.0,
        time_sampling_scale=0.999,
        time_sampling_offset=0.001,
        min_period=cfg.time_min_period,
        max_period=cfg.time_max_period,
        image_resolution=[side, side],
        tokenizer_max_length=cfg.prompt_length(),
        input_features={
            **{k: {"type": "VISUAL", "shape": [3, side, side]} for k in visual},
            "observation.state": {"type": "STATE", "shape": [state_dim]},
        },
        output_features={"action": {"type": "ACTION", "shape": [action_dim]}},
        empty_cameras=n_empty,
    )
    if normalization is not None:
        out["normalization_mapping"] = dict(normalization)
    out.setdefault(
        "normalization_mapping",
        {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
    )
    out.setdefault("device", "cpu")
    out.setdefault("use_amp", False)
    out.setdefault("use_relative_actions", False)
    return out


def save_lerobot_pi05(
    model: torch.nn.Module, directory: str | Path, lerobot_cfg: dict[str, Any]
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (LeRobot's names) into ``directory``."""
    return lrc.save_lerobot_directory(to_lerobot_state_dict(model), directory, lerobot_cfg)
