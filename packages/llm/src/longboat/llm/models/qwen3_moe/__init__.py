"""Qwen3-MoE (qk-norm attention, routed experts, no shared expert)."""

from longboat.llm.models.qwen3_moe import hf
from longboat.llm.models.qwen3_moe.config import FLAVORS
from longboat.llm.models.qwen3_moe.spec import layer_spec
from longboat.llm.models.registry import ModelFamily, register_family


@register_family
def qwen3_moe() -> ModelFamily:
    return ModelFamily(
        name="qwen3_moe",
        flavors=FLAVORS,
        hf_model_types=("qwen3_moe",),
        hf_architectures=("Qwen3MoeForCausalLM",),
        from_hf_config=hf.from_hf_config,
        to_hf_config=hf.to_hf_config,
        layer_spec=layer_spec,
    )
