"""Qwen2 / Qwen2.5 <-> Hugging Face ``Qwen2ForCausalLM`` config (and Qwen2.5-VL's text config)."""

from __future__ import annotations

from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.models.common import common_from_hf, common_to_hf
from longboat.core.megatron.models.config import DecoderModelConfig

QWEN2_5_VL_MROPE = [16, 24, 24]
"""transformers' default M-RoPE sections for Qwen2.5-VL (head_dim 128) when the config has none."""


def mrope_from_hf(hf: dict[str, Any], source: str) -> tuple[dict[str, Any], list[int] | None]:
    """``(config without the M-RoPE entries, mrope_section or None)``: a Qwen2.5-VL text
    config names its rotary ``mrope`` / ``default`` with a ``mrope_section``; the rest of
    its rotary is plain."""
    hf = dict(hf)
    section = None
    for key in ("rope_parameters", "rope_scaling"):
        params = dict(hf.get(key) or {})
        if "mrope_section" in params:
            section = [int(x) for x in params.pop("mrope_section")]
        if params.get("rope_type", params.get("type")) == "mrope":
            params["rope_type"] = "default"
            params.pop("type", None)
        if params:
            hf[key] = params
        else:
            hf.pop(key, None)
    if hf.get("model_type") == "qwen2_5_vl_text" and section is None:
        section = list(QWEN2_5_VL_MROPE)
    if section is not None and len(section) != 3:
        raise ConfigError(f"{source}: mrope_section={section!r}: expected three sizes.")
    return hf, section


def from_hf_config(hf: dict[str, Any]) -> DecoderModelConfig:
    """Model config from a Qwen2 ``config.json`` dict (q/k/v biases always on, no qk-norm)."""
    hf, section = mrope_from_hf(hf, "config.json")
    fields = common_from_hf(hf, "qwen2", "config.json")
    fields["attention_bias"] = True
    return DecoderModelConfig(**fields, qk_norm=False, mrope_section=section)


def to_hf_config(cfg: DecoderModelConfig) -> Any:
    """``transformers.Qwen2Config`` for ``cfg`` (a plain-rotary decoder)."""
    from transformers import Qwen2Config

    if cfg.mrope_section is not None:
        raise ConfigError(
            "model.mrope_section is set: an M-RoPE decoder is the language model of a VLM "
            "and is exported with it (longboat-vlm), not as a Qwen2ForCausalLM."
        )
    kwargs = common_to_hf(cfg)
    kwargs.pop("attention_bias")
    return Qwen2Config(**kwargs, use_sliding_window=False, architectures=["Qwen2ForCausalLM"])
