"""Llama 3 (dense, GQA, Llama-3 rotary scaling)."""

from longboat.core.megatron.models.llama3 import hf
from longboat.core.megatron.models.llama3.flavors import FLAVORS
from longboat.core.megatron.models.registry import ModelFamily, register_family


@register_family
def llama3() -> ModelFamily:
    return ModelFamily(
        name="llama3",
        flavors=FLAVORS,
        hf_model_types=("llama",),
        hf_architectures=("LlamaForCausalLM",),
        from_hf_config=hf.from_hf_config,
        to_hf_config=hf.to_hf_config,
    )
