"""The llm stack's model families: core's decoder families (``longboat.core.megatron.models``),
which the vlm stack's language models share."""

from longboat.core.megatron.models import (
    ModelFamily,
    family_for_hf_config,
    get_family,
    register_family,
)


def list_families() -> list[str]:
    """The decoder families the llm stack trains (its model schemas; core may register more,
    e.g. the M-RoPE language models of the vlm stack)."""
    from longboat.llm.stack import STACK

    return sorted(STACK.model_schemas)


__all__ = ["ModelFamily", "family_for_hf_config", "get_family", "list_families", "register_family"]
