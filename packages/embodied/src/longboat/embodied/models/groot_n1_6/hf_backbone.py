"""GR00T N1.6 from a Hugging Face backbone alone: SigLIP2 (the vision tower) or Qwen3 (the
backbone LM, truncated at ``select_layer``); ``hf_backbones`` reads the directory. The HF
keys are renamed into the Isaac-GR00T layout (whose names contain SigLIP2's and Qwen3's)
and mapped by ``weight_names``; the ``mlp1`` projector and the action head always stay at
their initialisation."""

from __future__ import annotations

import torch
from torch import Tensor

from longboat.embodied.models import hf_backbones
from longboat.embodied.models.groot_n1_6 import weight_names as wn
from longboat.embodied.models.hf_backbones import BackboneDir, BackboneKind

KINDS = {
    "siglip2_vision_model": BackboneKind(
        architecture="Siglip2VisionModel",
        prefixes=hf_backbones.VISION_ONLY,
        lm_style="qwen3",
        square_positions=True,
    ),
    "siglip2": BackboneKind(
        architecture="Siglip2Model",
        prefixes=hf_backbones.DUAL_VISION,
        ignored=hf_backbones.DUAL_IGNORED,
        lm_style="qwen3",
        square_positions=True,
    ),
    "qwen3": BackboneKind(
        architecture="Qwen3ForCausalLM",
        prefixes=hf_backbones.LM_ONLY,
        ignored=("lm_head.",),
        lm_style="qwen3",
        square_positions=True,
    ),
}
"""The Hugging Face backbones GR00T N1.6 initialises from (``model_type`` -> kind)."""

TARGETS = {"vision": wn.ISAAC_VISION, "llm": wn.ISAAC_LLM}
"""Backbone part -> its prefix in the Isaac-GR00T layout."""
_FIX = "use a backbone of the model's shapes (model.flavor / model.overrides)"


def _read_past(model: torch.nn.Module) -> tuple[str, ...]:
    layers = tuple(
        f"{wn.ISAAC_LLM}layers.{i}."
        for i in range(model.cfg.select_layer, model.cfg.llm.num_layers)
    )
    return (wn.ISAAC_VISION + "head.", wn.ISAAC_LLM + "lm_head.", *layers)


def backbone_state(
    model: torch.nn.Module, backbone: BackboneDir, state: dict[str, Tensor]
) -> dict[str, Tensor]:
    """Our keys -> tensors for the parts ``backbone`` holds (names and shapes checked)."""
    cfg = model.cfg
    targets = {p: TARGETS[p] for p in backbone.kind.prefixes}
    ref = hf_backbones.to_reference_names(
        backbone, state, targets, wn.isaac_shapes(model), ignored=_read_past(model), fix=_FIX
    )
    out = {ours: ref[theirs] for ours, theirs in wn.backbone_names(cfg).items() if theirs in ref}
    for fused, parts in wn.split_qkv_names(cfg).items():
        if all(p in ref for p in parts):
            out[fused] = torch.cat([ref[p] for p in parts], 0)
    if wn.ISAAC_PATCH_WEIGHT in ref:
        out["backbone.vision." + wn.PATCH_WEIGHT] = wn.linear_to_conv_patch(
            ref[wn.ISAAC_PATCH_WEIGHT], 3, cfg.vision.patch_size
        )
    return out


def initialised_parts(left: list[str]) -> list[str]:
    """Module names of the keys left at initialisation."""
    return hf_backbones.top_modules(left, {"backbone.": 2})
