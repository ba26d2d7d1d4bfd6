"""LLM model families (one folder each: config.py, spec.py, hf.py, README.md)."""

from longboat.llm.models.registry import (
    ModelFamily,
    family_for_hf_config,
    get_family,
    list_families,
    register_family,
)

__all__ = ["ModelFamily", "family_for_hf_config", "get_family", "list_families", "register_family"]
