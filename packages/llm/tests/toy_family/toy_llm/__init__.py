"""A toy LLM family kept outside the llm package (tests/toy_family, found through
``LONGBOAT_FAMILY_PATH``): a small Llama-style decoder with qk-norm and its own layer spec
function, written the way a user adds a family without editing longboat."""

from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.llm.models.family import decoder_family

FLAVORS = {
    "tiny": DecoderModelConfig(
        name="toy_llm",
        flavor="tiny",
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=8,
        ffn_hidden_size=64,
        max_position_embeddings=128,
        qk_norm=True,
        norm_eps=1e-6,
    )
}

SPEC_CALLS: list[str] = []
"""Backends the family's layer spec was asked for (the test reads it)."""


def layer_spec(cfg, backend, kernels):
    """Core's Llama-style layer, recording that the registry handed out this family's."""
    from longboat.core.megatron.decoder_build import dense_layer_spec

    SPEC_CALLS.append(backend)
    return dense_layer_spec(cfg, backend, kernels)


FAMILY = decoder_family(
    "toy_llm",
    FLAVORS,
    description="toy Llama-style decoder with qk-norm (a test family)",
    dialect="llama3",
    layer_spec=layer_spec,
)
