"""Hugging Face <-> longboat state dicts of the Qwen2.5-VL vision tower.

HF names the tower ``visual.*`` (transformers 4) or ``model.visual.*`` (transformers 5);
a bare ``Qwen2_5_VisionTransformerPretrainedModel`` state dict has no prefix. Ours is the
unsharded (TP=1) state dict of ``Qwen25VisionModel``; ``shard_vision_state_dict`` cuts it
for one tensor-parallel rank.

Layout differences: HF's Conv3d patch embedding is our Linear over flattened patches;
HF's fused ``qkv`` stacks all q heads, then all k, then all v, while megatron's ``linear_qkv``
interleaves them per head (q, k, v of head 0, then head 1, ...); HF's ``gate_proj`` /
``up_proj`` are stacked into megatron's ``linear_fc1``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from longboat.vlm.models.qwen2_5_vl.vision_config import Qwen25VisionConfig
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


def _block_map(i: int) -> dict[str, str]:
    """Our names -> HF names of block ``i`` for tensors that map one to one."""
    ours, hf = f"layers.{i}.", f"blocks.{i}."
    return {
        ours + "input_layernorm.weight": hf + "norm1.weight",
        ours + "pre_mlp_layernorm.weight": hf + "norm2.weight",
        ours + "self_attention.linear_proj.weight": hf + "attn.proj.weight",
        ours + "self_attention.linear_proj.bias": hf + "attn.proj.bias",
        ours + "mlp.linear_fc2.weight": hf + "mlp.down_proj.weight",
        ours + "mlp.linear_fc2.bias": hf + "mlp.down_proj.bias",
    }


_MERGER = {
    "merger.norm.weight": "merger.ln_q.weight",
    "merger.linear_fc1.weight": "merger.mlp.0.weight",
    "merger.linear_fc1.bias": "merger.mlp.0.bias",
    "merger.linear_fc2.weight": "merger.mlp.2.weight",
    "merger.linear_fc2.bias": "merger.mlp.2.bias",
}


def expected_hf_shapes(cfg: Qwen25VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor (unprefixed HF name) of the tower with its shape."""
    h, f, w = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit
    p, t, c = cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels
    shapes: dict[str, tuple[int, ...]] = {"patch_embed.proj.weight": (h, c, t, p, p)}
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        shapes |= {
            b + "norm1.weight": (h,),
            b + "norm2.weight": (h,),
            b + "attn.qkv.weight": (3 * h, h),
            b + "attn.qkv.bias": (3 * h,),
            b + "attn.proj.weight": (h, h),
            b + "attn.proj.bias": (h,),
            b + "mlp.gate_proj.weight": (f, h),
            b + "mlp.gate_proj.bias": (f,),
            b + "mlp.up_proj.weight": (f, h),
            b + "mlp.up_proj.bias": (f,),
            b + "mlp.down_proj.weight": (h, f),
            b + "mlp.down_proj.bias": (h,),
        }
    shapes |= {
        "merger.ln_q.weight": (h,),
        "merger.mlp.0.weight": (w, w),
        "merger.mlp.0.bias": (w,),
        "merger.mlp.2.weight": (cfg.out_hidden_size, w),
        "merger.mlp.2.bias": (cfg.out_hidden_size,),
    }
    return shapes


def _qkv_to_megatron(x: torch.Tensor, cfg: Qwen25VisionConfig) -> torch.Tensor:
    return qkv_to_megatron(x, cfg.num_heads, cfg.head_dim)


def _qkv_to_hf(x: torch.Tensor, cfg: Qwen25VisionConfig) -> torch.Tensor:
    return qkv_to_hf(x, cfg.num_heads, cfg.head_dim)


def vision_from_hf(
    state_dict: Mapping[str, torch.Tensor],
    cfg: Qwen25VisionConfig,
    *,
    prefix: str | None = None,
) -> dict[str, torch.Tensor]:
    """Our (unsharded) tower state dict from an HF one.

    ``state_dict`` may be a whole Qwen2.5-VL checkpoint (only the tower's keys are read) or
    the tower's own; ``prefix`` defaults to the one found (``detect_hf_prefix``). Raises
    ``VisionStateDictError`` naming missing, unexpected and wrongly shaped keys.
    """
    prefix = detect_hf_prefix(state_dict) if prefix is None else prefix
    hf = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    check_state_dict(hf, expected_hf_shapes(cfg), prefix, "HF vision state dict")
    out: dict[str, torch.Tensor] = {
        "patch_embed.weight": hf["patch_embed.proj.weight"].reshape(cfg.hidden_size, -1)
    }
    for i in range(cfg.depth):
        b, ours = f"blocks.{i}.", f"layers.{i}."
        for name, hf_name in _block_map(i).items():
            out[name] = hf[hf_name]
        for kind in ("weight", "bias"):
            out[ours + f"self_attention.linear_qkv.{kind}"] = _qkv_to_megatron(
                hf[b + f"attn.qkv.{kind}"], cfg
            )
            out[ours + f"mlp.linear_fc1.{kind}"] = torch.cat(
                [hf[b + f"mlp.gate_proj.{kind}"], hf[b + f"mlp.up_proj.{kind}"]], 0
            )
    for name, hf_name in _MERGER.items():
        out[name] = hf[hf_name]
    return out


def expected_shapes(cfg: Qwen25VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of our unsharded tower state dict with its shape."""
    h, f, w = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit
    shapes: dict[str, tuple[int, ...]] = {"patch_embed.weight": (h, cfg.patch_dim)}
    for i in range(cfg.depth):
        b = f"layers.{i}."
        shapes |= {
            b + "input_layernorm.weight": (h,),
            b + "pre_mlp_layernorm.weight": (h,),
            b + "self_attention.linear_qkv.weight": (3 * h, h),
            b + "self_attention.linear_qkv.bias": (3 * h,),
            b + "self_attention.linear_proj.weight": (h, h),
            b + "self_attention.linear_proj.bias": (h,),
            b + "mlp.linear_fc1.weight": (2 * f, h),
            b + "mlp.linear_fc1.bias": (2 * f,),
            b + "mlp.linear_fc2.weight": (h, f),
            b + "mlp.linear_fc2.bias": (h,),
        }
    shapes |= {
        "merger.norm.weight": (h,),
        "merger.linear_fc1.weight": (w, w),
        "merger.linear_fc1.bias": (w,),
        "merger.linear_fc2.weight": (cfg.out_hidden_size, w),
        "merger.linear_fc2.bias": (cfg.out_hidden_size,),
    }
    return shapes


def vision_to_hf(
    state_dict: Mapping[str, torch.Tensor],
    cfg: Qwen25VisionConfig,
    *,
    prefix: str = "model.visual.",
) -> dict[str, torch.Tensor]:
    """The HF tensors (named with ``prefix``) of our unsharded tower state dict."""
    ours = {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}
    check_state_dict(ours, expected_shapes(cfg), "", "vision state dict")
    p, t, c = cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels
    hf: dict[str, torch.Tensor] = {
        "patch_embed.proj.weight": ours["patch_embed.weight"].reshape(cfg.hidden_size, c, t, p, p)
    }
    for i in range(cfg.depth):
        b, o = f"blocks.{i}.", f"layers.{i}."
        for name, hf_name in _block_map(i).items():
            hf[hf_name] = ours[name]
        for kind in ("weight", "bias"):
            hf[b + f"attn.qkv.{kind}"] = _qkv_to_hf(
                ours[o + f"self_attention.linear_qkv.{kind}"], cfg
            )
            gate, up = ours[o + f"mlp.linear_fc1.{kind}"].chunk(2, 0)
            hf[b + f"mlp.gate_proj.{kind}"] = gate
            hf[b + f"mlp.up_proj.{kind}"] = up
    for name, hf_name in _MERGER.items():
        hf[hf_name] = ours[name]
    return {prefix + k: v for k, v in hf.items()}


def _tp_kind(name: str) -> str:
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")) or name.startswith(
        "merger.linear_fc1."
    ):
        return "rows"
    if name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")):
        return "gate_up"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    return "replicated"


def shard_vision_state_dict(
    state_dict: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``tp_rank``'s part of our unsharded tower state dict.

    megatron's per-head interleaved ``linear_qkv`` keeps each rank's heads contiguous, so a
    row split gives each rank whole heads; ``linear_fc1`` holds this rank's gate rows, then
    its up rows; row-parallel weights are split by column; biases of row-parallel linears,
    norms and the patch embedding are replicated.
    """
    return shard_state_dict(state_dict, tp_rank, tp_size, _tp_kind)


def unshard_vision_state_dict(
    shards: Sequence[Mapping[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The unsharded tower state dict from every tensor-parallel rank's part (in rank
    order): the inverse of :func:`shard_vision_state_dict`."""
    return unshard_state_dict(shards, _tp_kind)
