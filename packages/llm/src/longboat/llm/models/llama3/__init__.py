"""Llama 3 (dense, GQA, Llama-3 rotary scaling)."""

from longboat.llm.models.llama3 import hf
from longboat.llm.models.llama3.config import FLAVORS
from longboat.llm.models.llama3.spec import layer_spec
from longboat.llm.models.registry import ModelFamily, register_family


@register_family
def llama3() -> ModelFamily:
    return ModelFamily(
        name="llama3",
        flavors=FLAVORS,
        hf_model_types=("llama",),
        hf_architectures=("LlamaForCausalLM",),
        from_hf_config=hf.from_hf_config,
        to_hf_config=hf.to_hf_config,
        layer_spec=layer_spec,
    )
