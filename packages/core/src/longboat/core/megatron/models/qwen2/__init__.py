"""Qwen2 / Qwen2.5 dense (GQA, biased q/k/v projections); the language model of Qwen2.5-VL."""

from longboat.core.megatron.models.qwen2 import hf
from longboat.core.megatron.models.qwen2.flavors import FLAVORS
from longboat.core.megatron.models.registry import ModelFamily, register_family


@register_family
def qwen2() -> ModelFamily:
    return ModelFamily(
        name="qwen2",
        flavors=FLAVORS,
        hf_model_types=("qwen2", "qwen2_5_vl_text"),
        hf_architectures=("Qwen2ForCausalLM",),
        from_hf_config=hf.from_hf_config,
        to_hf_config=hf.to_hf_config,
    )
