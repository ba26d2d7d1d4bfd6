"""GR00T weight names: ours <-> NVIDIA's (Isaac-GR00T N1.6, and LeRobot's GR00T N1.7 action
head, which keeps the same module names).

``action_head_names`` covers the parts N1.6 and N1.7 share (vlln, per-embodiment state and
action encoders and decoder, position embedding, the alternating DiT); ``backbone_names``
the N1.6 Eagle backbone (SigLIP2 tower, ``mlp1`` projector, Qwen3 layers). Three tensors
need more than a rename: the ViT's fused qkv (split into q/k/v), SigLIP2's linear patch
embedding (ours is the equivalent Conv2d; SigLIP2 patchifies in (row, col, channel) order)
and, for LeRobot's N1.7, the state mask token it does not have (its state dropout zeroes
the state token, which a zero mask token reproduces).

``convert_to_ours`` checks every name and shape first and raises one CheckpointError
listing the missing, unexpected and mis-shaped keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from longboat.embodied.models.common.checkpoint_files import mismatch_report, raise_on_mismatch
from longboat.embodied.models.groot_n1_6.config import GrootN16Config

ISAAC_VISION = "backbone.model.vision_model.vision_model."
ISAAC_PROJECTOR = "backbone.model.mlp1."
ISAAC_LLM = "backbone.model.language_model.model."
ISAAC_ACTION_HEAD = "action_head."
ISAAC_UNUSED = (
    "backbone.model.language_model.lm_head.",
    ISAAC_VISION + "head.",
)
"""Prefixes Isaac-GR00T may store that never reach the action head (the LM head, SigLIP2's
pooling head): read past on load, not written."""


def _pairs(ours: str, theirs: str, params: Iterable[str] = ("weight", "bias")) -> dict[str, str]:
    return {f"{ours}.{p}": f"{theirs}.{p}" for p in params}


def action_head_names(cfg: GrootN16Config, prefix: str) -> dict[str, str]:
    """Our ``action_head.*`` key -> NVIDIA's key under ``prefix`` (one-to-one renames)."""
    m: dict[str, str] = {}
    ah, p = "action_head.", prefix
    m |= _pairs(ah + "vlln", p + "vlln")
    m[ah + "position_embedding.weight"] = p + "position_embedding.weight"
    for mlp in ("state_encoder", "action_decoder"):
        for layer in ("layer1", "layer2"):
            m |= {
                f"{ah}{mlp}.{layer}.weight": f"{p}{mlp}.{layer}.W",
                f"{ah}{mlp}.{layer}.bias": f"{p}{mlp}.{layer}.b",
            }
    for w in ("W1", "W2", "W3"):
        m |= {
            f"{ah}action_encoder.{w}.weight": f"{p}action_encoder.{w}.W",
            f"{ah}action_encoder.{w}.bias": f"{p}action_encoder.{w}.b",
        }
    dit, theirs = ah + "model.", p + "model."
    for lin in ("linear_1", "linear_2"):
        m |= _pairs(
            f"{dit}timestep_encoder.{lin}", f"{theirs}timestep_encoder.timestep_embedder.{lin}"
        )
    for i in range(cfg.dit.num_layers):
        ob, tb = f"{dit}blocks.{i}.", f"{theirs}transformer_blocks.{i}."
        m |= _pairs(ob + "norm1_linear", tb + "norm1.linear")
        for proj in ("to_q", "to_k", "to_v"):
            m |= _pairs(f"{ob}attn.{proj}", f"{tb}attn1.{proj}")
        m |= _pairs(ob + "attn.to_out", tb + "attn1.to_out.0")
        m |= _pairs(ob + "ff_in", tb + "ff.net.0.proj")
        m |= _pairs(ob + "ff_out", tb + "ff.net.2")
    m |= _pairs(dit + "proj_out_1", theirs + "proj_out_1")
    m |= _pairs(dit + "proj_out_2", theirs + "proj_out_2")
    if cfg.state_dropout_prob > 0:
        m[ah + "mask_token"] = p + "mask_token"
    return m


def backbone_names(cfg: GrootN16Config) -> dict[str, str]:
    """Our ``backbone.*`` key -> Isaac-GR00T N1.6's, except the fused qkv and patch embedding
    (``split_qkv_names``, ``PATCH_EMBED``)."""
    m: dict[str, str] = {}
    v = ISAAC_VISION
    m[f"backbone.vision.{PATCH_BIAS}"] = v + "embeddings.patch_embedding.bias"
    m["backbone.vision.pos_embed"] = v + "embeddings.position_embedding.weight"
    m |= _pairs("backbone.vision.post_layernorm", v + "post_layernorm")
    for i in range(cfg.vision.num_layers):
        ob, tb = f"backbone.vision.blocks.{i}.", f"{v}encoder.layers.{i}."
        for ours, theirs in (
            ("layer_norm1", "layer_norm1"),
            ("layer_norm2", "layer_norm2"),
            ("out_proj", "self_attn.out_proj"),
            ("fc1", "mlp.fc1"),
            ("fc2", "mlp.fc2"),
        ):
            m |= _pairs(ob + ours, tb + theirs)
    m |= _pairs("backbone.projector.norm", ISAAC_PROJECTOR + "0")
    m |= _pairs("backbone.projector.fc1", ISAAC_PROJECTOR + "1")
    m |= _pairs("backbone.projector.fc2", ISAAC_PROJECTOR + "3")
    m["backbone.llm.embed_tokens.weight"] = ISAAC_LLM + "embed_tokens.weight"
    for i in range(cfg.select_layer):
        ob, tb = f"backbone.llm.layers.{i}.", f"{ISAAC_LLM}layers.{i}."
        attn = ("q_proj", "k_proj", "v_proj", "o_proj")
        for a in attn + (("q_norm", "k_norm") if cfg.llm.qk_norm else ()):
            m[f"{ob}{a}.weight"] = f"{tb}self_attn.{a}.weight"
        for a in ("gate_proj", "up_proj", "down_proj"):
            m[f"{ob}mlp.{a}.weight"] = f"{tb}mlp.{a}.weight"
        m[f"{ob}input_norm.weight"] = f"{tb}input_layernorm.weight"
        m[f"{ob}post_attention_norm.weight"] = f"{tb}post_attention_layernorm.weight"
    m["backbone.llm.norm.weight"] = ISAAC_LLM + "norm.weight"
    return m


PATCH_WEIGHT, PATCH_BIAS = "patch_embed.weight", "patch_embed.bias"
ISAAC_PATCH_WEIGHT = ISAAC_VISION + "embeddings.patch_embedding.weight"


def split_qkv_names(cfg: GrootN16Config) -> dict[str, list[str]]:
    """Our fused ``qkv.{weight,bias}`` key -> SigLIP2's q / k / v keys."""
    out = {}
    for i in range(cfg.vision.num_layers):
        for p in ("weight", "bias"):
            theirs = f"{ISAAC_VISION}encoder.layers.{i}.self_attn."
            out[f"backbone.vision.blocks.{i}.qkv.{p}"] = [f"{theirs}{n}_proj.{p}" for n in "qkv"]
    return out


def conv_to_linear_patch(weight: Tensor) -> Tensor:
    """Conv2d patch weight [D, C, p, p] -> SigLIP2's Linear weight [D, p*p*C]."""
    return weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1)


def linear_to_conv_patch(weight: Tensor, channels: int, patch: int) -> Tensor:
    """SigLIP2's Linear patch weight [D, p*p*C] -> Conv2d weight [D, C, p, p]."""
    return weight.reshape(weight.shape[0], patch, patch, channels).permute(0, 3, 1, 2)


def isaac_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Isaac-GR00T N1.6 key -> shape for our ``model`` (any device, meta included)."""
    cfg: GrootN16Config = model.cfg
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names = {**backbone_names(cfg), **action_head_names(cfg, ISAAC_ACTION_HEAD)}
    out = {theirs: ours[k] for k, theirs in names.items()}
    d = cfg.vision.hidden_size
    for key in split_qkv_names(cfg).values():
        for name in key:
            out[name] = (d, d) if name.endswith("weight") else (d,)
    p = cfg.vision.patch_size
    out[ISAAC_PATCH_WEIGHT] = (d, 3 * p * p)
    return out


def to_isaac(model: torch.nn.Module) -> dict[str, Tensor]:
    """Our GR00T weights under Isaac-GR00T N1.6's names (contiguous copies, dtypes kept)."""
    cfg: GrootN16Config = model.cfg
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    names = {**backbone_names(cfg), **action_head_names(cfg, ISAAC_ACTION_HEAD)}
    out = {theirs: ours[k] for k, theirs in names.items()}
    for fused, parts in split_qkv_names(cfg).items():
        for name, t in zip(parts, ours[fused].chunk(3, dim=0), strict=True):
            out[name] = t
    out[ISAAC_PATCH_WEIGHT] = conv_to_linear_patch(ours["backbone.vision." + PATCH_WEIGHT])
    return {k: v.contiguous().clone() for k, v in out.items()}


def from_isaac(
    model: torch.nn.Module, state: Mapping[str, Tensor], *, source: str = "checkpoint"
) -> dict[str, Tensor]:
    """Isaac-GR00T N1.6-named ``state`` -> our state dict for ``model`` (names and shapes
    checked first)."""
    cfg: GrootN16Config = model.cfg
    report = mismatch_report(isaac_shapes(model), state, ignored=ISAAC_UNUSED)
    raise_on_mismatch(
        source,
        "groot_n1_6 as its config.json describes it",
        report,
        "use the config.json saved with these weights (model_name, select_layer, "
        "diffusion_model_cfg, max_state_dim, max_action_dim, max_num_embodiments)",
    )
    names = {**backbone_names(cfg), **action_head_names(cfg, ISAAC_ACTION_HEAD)}
    out = {k: state[theirs] for k, theirs in names.items()}
    for fused, parts in split_qkv_names(cfg).items():
        out[fused] = torch.cat([state[p] for p in parts], dim=0)
    out["backbone.vision." + PATCH_WEIGHT] = linear_to_conv_patch(
        state[ISAAC_PATCH_WEIGHT], 3, cfg.vision.patch_size
    )
    return out
