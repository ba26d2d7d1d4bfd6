"""Qwen2.5-VL: vision tower, decoder with M-RoPE, HF conversion."""

from types import ModuleType

from longboat.vlm.models.qwen2_5_vl.flops import flops_per_sample
from longboat.vlm.models.registry import vlm_family


def _implementation() -> ModuleType:
    from longboat.vlm.models.qwen2_5_vl import model

    return model


FAMILY = vlm_family(
    "qwen2_5_vl",
    implementation=_implementation,
    flavors=("tiny", "3b", "7b"),
    hf_model_types=("qwen2_5_vl",),
    flops_per_sample=flops_per_sample,
    description="Qwen2.5-VL: window-attention ViT + patch merger + Qwen2 decoder, M-RoPE",
)
