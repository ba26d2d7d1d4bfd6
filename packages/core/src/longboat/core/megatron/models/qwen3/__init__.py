"""Qwen3 dense (GQA, qk-norm, decoupled head_dim)."""

from longboat.core.megatron.models.qwen3 import hf
from longboat.core.megatron.models.qwen3.flavors import FLAVORS
from longboat.core.megatron.models.registry import ModelFamily, register_family


@register_family
def qwen3() -> ModelFamily:
    return ModelFamily(
        name="qwen3",
        flavors=FLAVORS,
        hf_model_types=("qwen3",),
        hf_architectures=("Qwen3ForCausalLM",),
        from_hf_config=hf.from_hf_config,
        to_hf_config=hf.to_hf_config,
    )
