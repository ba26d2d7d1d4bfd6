"""Qwen3-MoE (qk-norm attention, routed experts, no shared expert)."""

from longboat.core.megatron.models.qwen3_moe import hf
from longboat.core.megatron.models.qwen3_moe.flavors import FLAVORS
from longboat.core.megatron.models.registry import ModelFamily, register_family


@register_family
def qwen3_moe() -> ModelFamily:
    return ModelFamily(
        name="qwen3_moe",
        flavors=FLAVORS,
        hf_model_types=("qwen3_moe",),
        hf_architectures=("Qwen3MoeForCausalLM",),
        from_hf_config=hf.from_hf_config,
        to_hf_config=hf.to_hf_config,
    )
