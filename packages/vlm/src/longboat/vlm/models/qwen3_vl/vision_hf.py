"""Hugging Face <-> longboat state dicts of the Qwen3-VL vision tower.

HF names the tower ``model.visual.*`` (what ``Qwen3VLForConditionalGeneration`` holds and
the released files use) or ``visual.*``; a bare ``Qwen3VLVisionModel`` state dict has no
prefix. Ours is the unsharded (TP=1) state dict of ``Qwen3VisionModel``;
``shard_vision_state_dict`` cuts it for one tensor-parallel rank.

Layout differences: HF's Conv3d patch embedding is our Linear over flattened patches; HF's
fused ``qkv`` stacks all q heads, then all k, then all v, while megatron's ``linear_qkv``
interleaves them per head; HF's ``merger`` / ``deepstack_merger_list.<k>`` are our
``merger.patch`` / ``merger.deepstack.<k>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from longboat.vlm.models.qwen3_vl.vision_config import Qwen3VisionConfig
from longboat.vlm.models.vit_state import HF_PREFIXES as HF_PREFIXES  # re-exported
from longboat.vlm.models.vit_state import VisionStateDictError as VisionStateDictError
from longboat.vlm.models.vit_state import (
    check_state_dict,
    detect_hf_prefix,
    qkv_to_hf,
    qkv_to_megatron,
    shard_state_dict,
    unshard_state_dict,
)


def _merger_map(ours: str, hf: str) -> dict[str, str]:
    names = ("norm.weight", "norm.bias", "linear_fc1.weight", "linear_fc1.bias",
             "linear_fc2.weight", "linear_fc2.bias")  # fmt: skip
    return {f"{ours}.{n}": f"{hf}.{n}" for n in names}


def _one_to_one(cfg: Qwen3VisionConfig) -> dict[str, str]:
    """Our names -> HF names of the tensors that map without a layout change."""
    out = {"patch_embed.bias": "patch_embed.proj.bias", "position_embedding": "pos_embed.weight"}
    for i in range(cfg.depth):
        o, h = f"layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            out |= {
                f"{o}input_layernorm.{kind}": f"{h}norm1.{kind}",
                f"{o}pre_mlp_layernorm.{kind}": f"{h}norm2.{kind}",
                f"{o}self_attention.linear_proj.{kind}": f"{h}attn.proj.{kind}",
                f"{o}mlp.linear_fc1.{kind}": f"{h}mlp.linear_fc1.{kind}",
                f"{o}mlp.linear_fc2.{kind}": f"{h}mlp.linear_fc2.{kind}",
            }
    out |= _merger_map("merger.patch", "merger")
    for k in range(len(cfg.deepstack_visual_indexes)):
        out |= _merger_map(f"merger.deepstack.{k}", f"deepstack_merger_list.{k}")
    return out


def expected_shapes(cfg: Qwen3VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of our unsharded tower state dict with its shape."""
    h, f, w, o = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit, \
        cfg.out_hidden_size  # fmt: skip
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.weight": (h, cfg.patch_dim),
        "patch_embed.bias": (h,),
        "position_embedding": (cfg.num_position_embeddings, h),
    }
    for i in range(cfg.depth):
        b = f"layers.{i}."
        shapes |= {
            b + "input_layernorm.weight": (h,), b + "input_layernorm.bias": (h,),
            b + "pre_mlp_layernorm.weight": (h,), b + "pre_mlp_layernorm.bias": (h,),
            b + "self_attention.linear_qkv.weight": (3 * h, h),
            b + "self_attention.linear_qkv.bias": (3 * h,),
            b + "self_attention.linear_proj.weight": (h, h),
            b + "self_attention.linear_proj.bias": (h,),
            b + "mlp.linear_fc1.weight": (f, h), b + "mlp.linear_fc1.bias": (f,),
            b + "mlp.linear_fc2.weight": (h, f), b + "mlp.linear_fc2.bias": (h,),
        }  # fmt: skip
    mergers = [("merger.patch.", h)] + [
        (f"merger.deepstack.{k}.", w) for k in range(len(cfg.deepstack_visual_indexes))
    ]
    for m, norm in mergers:
        shapes |= {
            m + "norm.weight": (norm,), m + "norm.bias": (norm,),
            m + "linear_fc1.weight": (w, w), m + "linear_fc1.bias": (w,),
            m + "linear_fc2.weight": (o, w), m + "linear_fc2.bias": (o,),
        }  # fmt: skip
    return shapes


def expected_hf_shapes(cfg: Qwen3VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor (unprefixed HF name) of the tower with its shape."""
    ours = expected_shapes(cfg)
    out = {hf: ours[name] for name, hf in _one_to_one(cfg).items()}
    h, p = cfg.hidden_size, cfg.patch_size
    out["patch_embed.proj.weight"] = (h, cfg.in_channels, cfg.temporal_patch_size, p, p)
    for i in range(cfg.depth):
        out[f"blocks.{i}.attn.qkv.weight"] = (3 * h, h)
        out[f"blocks.{i}.attn.qkv.bias"] = (3 * h,)
    return out


def _qkv_to_megatron(x: torch.Tensor, cfg: Qwen3VisionConfig) -> torch.Tensor:
    return qkv_to_megatron(x, cfg.num_heads, cfg.head_dim)


def _qkv_to_hf(x: torch.Tensor, cfg: Qwen3VisionConfig) -> torch.Tensor:
    return qkv_to_hf(x, cfg.num_heads, cfg.head_dim)


def vision_from_hf(
    state_dict: Mapping[str, torch.Tensor],
    cfg: Qwen3VisionConfig,
    *,
    prefix: str | None = None,
) -> dict[str, torch.Tensor]:
    """Our (unsharded) tower state dict from an HF one.

    ``state_dict`` may be a whole Qwen3-VL checkpoint (only the tower's keys are read) or the
    tower's own; ``prefix`` defaults to the one found (``detect_hf_prefix``). Raises
    ``VisionStateDictError`` naming missing, unexpected and wrongly shaped keys.
    """
    prefix = detect_hf_prefix(state_dict) if prefix is None else prefix
    hf = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    check_state_dict(hf, expected_hf_shapes(cfg), prefix, "HF vision state dict")
    out = {ours: hf[theirs] for ours, theirs in _one_to_one(cfg).items()}
    out["patch_embed.weight"] = hf["patch_embed.proj.weight"].reshape(cfg.hidden_size, -1)
    for i in range(cfg.depth):
        for kind in ("weight", "bias"):
            out[f"layers.{i}.self_attention.linear_qkv.{kind}"] = _qkv_to_megatron(
                hf[f"blocks.{i}.attn.qkv.{kind}"], cfg
            )
    return out


def vision_to_hf(
    state_dict: Mapping[str, torch.Tensor],
    cfg: Qwen3VisionConfig,
    *,
    prefix: str = "model.visual.",
) -> dict[str, torch.Tensor]:
    """The HF tensors (named with ``prefix``) of our unsharded tower state dict."""
    ours = {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}
    check_state_dict(ours, expected_shapes(cfg), "", "vision state dict")
    p, t, c = cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels
    hf = {theirs: ours[name] for name, theirs in _one_to_one(cfg).items()}
    hf["patch_embed.proj.weight"] = ours["patch_embed.weight"].reshape(cfg.hidden_size, c, t, p, p)
    for i in range(cfg.depth):
        for kind in ("weight", "bias"):
            hf[f"blocks.{i}.attn.qkv.{kind}"] = _qkv_to_hf(
                ours[f"layers.{i}.self_attention.linear_qkv.{kind}"], cfg
            )
    return {prefix + k: v for k, v in hf.items()}


def _tp_kind(name: str) -> str:
    # Column-parallel linears (q/k/v per head, MLP / merger first linear) split their rows,
    # row-parallel ones their weight's columns; their biases, norms and embeddings replicate.
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight",
                      "linear_fc1.bias")):  # fmt: skip
        return "rows"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    return "replicated"


def shard_vision_state_dict(
    state_dict: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``tp_rank``'s part of our unsharded tower state dict (megatron's
    per-head ``linear_qkv`` keeps each rank's heads contiguous, so a row split gives each
    rank whole heads)."""
    return shard_state_dict(state_dict, tp_rank, tp_size, _tp_kind)


def unshard_vision_state_dict(
    shards: Sequence[Mapping[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The unsharded tower state dict from every tensor-parallel rank's part (in rank
    order): the inverse of :func:`shard_vision_state_dict`."""
    return unshard_state_dict(shards, _tp_kind)
