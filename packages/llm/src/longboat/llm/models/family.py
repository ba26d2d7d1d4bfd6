"""What the llm stack's families share: ``LLMFamily`` (the core ``Family`` plus the pieces a
megatron decoder needs), the Hugging Face adapter and the FLOPs of one sample.

A family folder holds ``config.py`` (its ``FLAVORS``) and an ``__init__.py`` exposing
``FAMILY = decoder_family(...)``; nothing here imports torch or megatron until used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longboat.core.family import Family
from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.hf_decoder_config import HFDecoderDialect, hf_dialect


@dataclass(frozen=True)
class HFDecoderAdapter:
    """A decoder's weights and config to and from a Hugging Face ``*ForCausalLM`` directory
    (config dialect from core, tensors under ``prefix``)."""

    dialect: HFDecoderDialect
    """How the family's config is spelled in ``config.json``."""
    prefix: str = "model."
    """Prefix of the decoder tensors in the HF state dict."""
    format: str = "hf"
    weights: Any = None
    """The weight mapping (``load(chunks, config, directory, progress=None) -> int`` and
    ``save(chunks, config, directory) -> None``, collective) for a family whose tensors are
    not the Llama-style decoder's; None: core's ``hf_io`` mapping."""

    def read_config(self, directory: str | Path) -> DecoderModelConfig:
        """The model config of ``<directory>/config.json``."""
        from longboat.llm.hf_checkpoint import read_hf_config

        return read_hf_config(directory)

    def load(self, model: Any, config: DecoderModelConfig, directory: str | Path) -> int:
        """Load the directory into this rank's chunks ``model`` (checked against ``config``)."""
        from longboat.llm.hf_checkpoint import load_hf

        return load_hf(model, config, directory)

    def save(self, model: Any, config: DecoderModelConfig, directory: str | Path) -> Path:
        """Write config.json + safetensors that ``transformers`` loads (collective)."""
        from longboat.llm.hf_checkpoint import save_hf

        return save_hf(model, config, directory)


@dataclass(frozen=True, kw_only=True)
class LLMFamily(Family):
    """An llm family: a megatron decoder whose model config is a ``DecoderModelConfig``."""

    adapter: HFDecoderAdapter
    layer_spec_fn: Callable[..., Any] | None = None
    """``layer_spec(cfg, backend, kernels)`` -> the ``ModuleSpec`` of one decoder layer (or,
    for a family with a ``chunk_builder``, whatever that builder takes, e.g. every layer's
    spec); None: core's Llama-style ``dense_layer_spec`` (qk-norm and MoE read from the
    config)."""
    chunk_builder: Callable[..., Any] | None = None
    """``chunk_builder(cfg, *, kernels, moe_router, precision, device_type, layout,
    **transformer_config_overrides)`` -> this rank's megatron model chunks, for a family whose
    model is not core's ``build_decoder`` (its own ``TransformerConfig``, per-layer specs,
    extra blocks); None: ``build_decoder`` with ``layer_spec``."""
    lora: bool = True
    """Whether the family takes ``lora.enabled=true`` (LoRA on its linears, the PEFT adapter
    export); False: refused at compose time."""
    lora_targets: Any = None
    """The family's LoRA targets (``LoRATargets``: the default ``lora.targets`` of a model
    config and the problems of a given list); None: the Llama-style linears (core's default
    ``lora.targets``), not checked."""
    notes: Mapping[str, str] = field(default_factory=dict)

    @property
    def hf_prefix(self) -> str:
        """Prefix of the decoder tensors in the HF state dict."""
        return self.adapter.prefix

    def from_hf_config(self, hf: dict[str, Any]) -> DecoderModelConfig:
        """HF ``config.json`` dict -> model config."""
        return self.adapter.dialect.from_hf_config(hf)

    def to_hf_config(self, cfg: DecoderModelConfig) -> Any:
        """Model config -> a ``transformers`` config object."""
        return self.adapter.dialect.to_hf_config(cfg)

    def layer_spec(self, cfg: DecoderModelConfig, backend: str, kernels: Any) -> Any:
        """The megatron ``ModuleSpec`` of one decoder layer of ``cfg``."""
        if self.layer_spec_fn is not None:
            return self.layer_spec_fn(cfg, backend, kernels)
        from longboat.core.megatron.decoder_build import dense_layer_spec

        return dense_layer_spec(cfg, backend, kernels)


def param_counts(cfg: DecoderModelConfig) -> tuple[int, int]:
    """``(every parameter, the parameters one token passes through)``: equal for a dense
    model; an MoE model's token passes through its top-k experts only. ``cfg`` may be any
    object with the decoder's shape fields (``qk_norm`` and ``num_experts`` default off)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    experts = getattr(cfg, "num_experts", 0)
    attn = h * cfg.num_attention_heads * hd * 2 + 2 * h * cfg.num_query_groups * hd
    base = attn + 2 * h + (2 * hd if getattr(cfg, "qk_norm", False) else 0)
    emb = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * h + h
    if not experts:
        n = emb + cfg.num_layers * (base + 3 * h * cfg.ffn_hidden_size)
        return n, n
    expert = 3 * h * cfg.moe_ffn_hidden_size
    base += h * experts  # the router
    return (emb + cfg.num_layers * (base + experts * expert),
            emb + cfg.num_layers * (base + cfg.moe_topk * expert))  # fmt: skip


def flops_per_token(cfg: DecoderModelConfig, seq_len: int) -> float:
    """Training FLOPs of one token in a sequence of ``seq_len``: 6 N + 6 L s d_attn, N the
    parameters a token passes through (embedding and head included), attention's QK^T and
    AV 2 * 2 * s * d_attn per token per layer forward, x3 for forward + backward, /2 for
    the causal mask; d_attn = heads * head_dim."""
    active = param_counts(cfg)[1]
    attention = 6.0 * cfg.num_layers * seq_len * cfg.num_attention_heads * cfg.head_dim
    return 6.0 * active + attention


def flops_per_sample(cfg: DecoderModelConfig, seq_len: int) -> float:
    """Training FLOPs of one sequence of ``seq_len`` tokens (``seq_len`` x ``flops_per_token``)."""
    return seq_len * flops_per_token(cfg, seq_len)


def decoder_family(
    name: str,
    flavors: Mapping[str, DecoderModelConfig],
    *,
    description: str,
    dialect: str | HFDecoderDialect | None = None,
    hf_prefix: str = "model.",
    layer_spec: Callable[..., Any] | None = None,
    schema: type[DecoderModelConfig] = DecoderModelConfig,
    chunk_builder: Callable[..., Any] | None = None,
    weights: Any = None,
    flops: Callable[..., float] = flops_per_sample,
    lora: bool = True,
    lora_targets: Any = None,
) -> LLMFamily:
    """The ``LLMFamily`` of a decoder: ``dialect`` names core's HF config dialect (default:
    the one of ``name``) or is a dialect of the family's own; ``layer_spec`` replaces the
    Llama-style layer. A family of another architecture also gives its ``schema`` (a
    ``DecoderModelConfig`` subclass), ``chunk_builder`` (``LLMFamily.chunk_builder``), HF
    ``weights`` mapping (``HFDecoderAdapter.weights``), ``flops`` per sample, whether it
    takes ``lora`` and its ``lora_targets`` (``LLMFamily.lora_targets``)."""
    if dialect is None or isinstance(dialect, str):
        dialect = hf_dialect(dialect or name)
    return LLMFamily(
        name=name,
        stack="llm",
        schema=schema,
        flavors=dict(flavors),
        description=description,
        build=_build,
        adapter=HFDecoderAdapter(dialect, prefix=hf_prefix, weights=weights),
        checkpoint_types=(*dialect.model_types, *dialect.architectures),
        flops_per_sample=flops,
        layer_spec_fn=layer_spec,
        chunk_builder=chunk_builder,
        lora=lora,
        lora_targets=lora_targets,
    )


def _build(cfg: DecoderModelConfig, **options: Any) -> Any:
    from longboat.llm.build import build_model

    return build_model(cfg, **options)
