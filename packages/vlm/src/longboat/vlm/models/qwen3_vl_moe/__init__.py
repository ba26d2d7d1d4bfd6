"""Qwen3-VL-MoE: the Qwen3-VL tower with deepstack mergers over a Qwen3-MoE decoder,
composed from config, expert parallel, HF conversion."""

from types import ModuleType

from longboat.vlm.models.qwen3_vl.flops import flops_per_sample
from longboat.vlm.models.registry import vlm_family


def _implementation() -> ModuleType:
    from longboat.vlm.models.qwen3_vl_moe import model

    return model


FAMILY = vlm_family(
    "qwen3_vl_moe",
    implementation=_implementation,
    flavors=("tiny", "30b_a3b"),
    flops_per_sample=flops_per_sample,
    hf_model_types=("qwen3_vl_moe",),
    description="Qwen3-VL-MoE: Qwen3-VL's ViT with deepstack mergers + a Qwen3-MoE decoder (one config line swaps it), interleaved M-RoPE, expert parallel",
)
