"""Qwen3-VL (dense): vision tower with deepstack mergers, qwen3 decoder with interleaved
M-RoPE and deepstack injection, HF conversion."""

from types import ModuleType

from longboat.vlm.models.qwen3_vl.flops import flops_per_sample
from longboat.vlm.models.registry import vlm_family


def _implementation() -> ModuleType:
    from longboat.vlm.models.qwen3_vl import model

    return model


FAMILY = vlm_family(
    "qwen3_vl",
    implementation=_implementation,
    flavors=("tiny", "2b", "4b", "8b"),
    flops_per_sample=flops_per_sample,
    hf_model_types=("qwen3_vl",),
    description="Qwen3-VL (dense): ViT with deepstack mergers + Qwen3 decoder, interleaved M-RoPE, deepstack features added after the first decoder layers",
)
