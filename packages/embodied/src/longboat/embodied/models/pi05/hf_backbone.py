"""pi0.5 from a Hugging Face backbone alone: PaliGemma (vision tower + projector + Gemma
LM), SigLIP (vision tower) or Gemma (the VLM's language model); ``hf_backbones`` reads the
directory. The HF keys are renamed into LeRobot's layout (whose names contain PaliGemma's)
and mapped by ``lerobot_format``; the action expert, the time MLP and the action
projections always stay at their initialisation."""

from __future__ import annotations

import torch
from torch import Tensor

from longboat.embodied.models import hf_backbones
from longboat.embodied.models.hf_backbones import BackboneDir, BackboneKind
from longboat.embodied.models.pi05 import lerobot_format as lf

KINDS = {
    "paligemma": BackboneKind(
        architecture="PaliGemmaForConditionalGeneration",
        prefixes=hf_backbones.PALIGEMMA_PREFIXES,
        ignored=("lm_head.",),
    ),
    "siglip_vision_model": BackboneKind(
        architecture="SiglipVisionModel", prefixes=hf_backbones.VISION_ONLY
    ),
    "siglip": BackboneKind(
        architecture="SiglipModel",
        prefixes=hf_backbones.DUAL_VISION,
        ignored=hf_backbones.DUAL_IGNORED,
    ),
    "gemma": BackboneKind(
        architecture="GemmaForCausalLM", prefixes=hf_backbones.LM_ONLY, ignored=("lm_head.",)
    ),
}
"""The Hugging Face backbones pi0.5 initialises from (``model_type`` -> kind)."""

TARGETS = {
    "vision": lf.VISION_PREFIX,
    "projector": lf.PALIGEMMA_PREFIX + "multi_modal_projector.",
    "llm": lf.LM_PREFIX,
}
"""Backbone part -> its prefix in LeRobot's layout."""
READ_PAST = (lf.VISION_PREFIX + "head.", lf.LM_PREFIX + "norm.", lf.LM_PREFIX + "lm_head.")
"""SigLIP's pooling head, Gemma's final norm and head: never read by pi0.5."""
_FIX = "use a backbone of the model's shapes (model.flavor / model.overrides)"


def _ours_to_reference(model: torch.nn.Module) -> dict[str, list[str]]:
    cfg = model.cfg
    out = {ours: [theirs] for ours, theirs in lf.renames(cfg).items()}
    for i in range(cfg.vision.num_layers):
        for p in ("weight", "bias"):
            out[f"vision.blocks.{i}.qkv.{p}"] = [f"{k}.{p}" for k in lf.qkv_keys(i)]
    return out


def backbone_state(
    model: torch.nn.Module, backbone: BackboneDir, state: dict[str, Tensor]
) -> dict[str, Tensor]:
    """Our keys -> tensors for the parts ``backbone`` holds (names and shapes checked)."""
    targets = {p: TARGETS[p] for p in backbone.kind.prefixes}
    ref = hf_backbones.to_reference_names(
        backbone,
        state,
        targets,
        lf.expected_lerobot_shapes(model),
        ignored=READ_PAST,
        fix=_FIX,
    )
    out = {}
    for ours, theirs in _ours_to_reference(model).items():
        if all(k in ref for k in theirs):
            out[ours] = (
                torch.cat([ref[k] for k in theirs], 0) if len(theirs) > 1 else ref[theirs[0]]
            )
    return out


def initialised_parts(left: list[str]) -> list[str]:
    """Module names of the keys left at initialisation (``joint.layers.*.expert`` as one)."""
    names = hf_backbones.top_modules(left, {})
    if any(k.startswith("joint.layers.") and ".expert." in k for k in left):
        names = [n for n in names if n != "joint"] + ["joint.layers.*.expert"]
    if any(k.startswith("joint.layers.") and ".lm." in k for k in left):
        names.append("joint.layers.*.lm")
    return names
