"""Decoder-only transformer architecture -> megatron ``TransformerConfig``.

``DecoderModelConfig`` is the one description of a Llama-style decoder (RMSNorm,
rotary, GQA, SwiGLU, optional qk-norm and mixture-of-experts): the model config of
the llm stack's families and the language model of the vlm stack's;
``to_transformer_config`` turns it plus a parallel layout into megatron-core's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from longboat.core.config.errors import ConfigError, ConfigProblem
from longboat.core.config.schema import ModelConfig

# torch is imported where a TransformerConfig is built: composing and validating a config
# (``DecoderModelConfig.validate``) must stay free of it.
_PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class DecoderModelConfig(ModelConfig):
    """A Llama-style decoder-only LM (RMSNorm, rotary, GQA, SwiGLU, optional qk-norm and
    mixture-of-experts): the model config of an LLM family and the language model of a VLM.
    Every architecture field maps onto one HF config key; defaults are the llama3 tiny flavor."""

    vocab_size: int = 256
    """Embedding rows (HF ``vocab_size``)."""
    hidden_size: int = 64
    """Model width."""
    num_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA)."""
    head_dim: int = 16
    """Per-head width."""
    ffn_hidden_size: int = 128
    """Dense SwiGLU width (MoE: the width HF reports as ``intermediate_size``)."""
    max_position_embeddings: int = 256
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Rotary base."""
    rope_scaling_factor: float | None = None
    """Llama-3 rotary scaling factor (None: no scaling)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    attention_bias: bool = False
    """Bias on q/k/v projections."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head."""
    num_experts: int = 0
    """Routed experts per layer (0 = dense)."""
    moe_topk: int = 2
    """Experts per token."""
    moe_ffn_hidden_size: int | None = None
    """Per-expert SwiGLU width."""
    moe_norm_topk_prob: bool = True
    """Renormalise top-k routing weights."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss weight."""
    moe_aux_loss: str = "auto"
    """Which load-balancing loss the llm stack trains with (when ``moe_aux_loss_coeff > 0``):
    ``hf`` (transformers' term, every layer's router logits pooled), ``megatron``
    (megatron-core's per-layer ``aux_loss``) or ``auto`` (``hf`` where the parallel layout
    allows it, else ``megatron``). Other stacks use megatron's."""
    moe_experts: str = "auto"
    """How the longboat layer spec runs the routed experts: ``grouped`` (all local experts'
    projections as stacked weights, two grouped GEMMs a layer, no host sync at EP=1),
    ``sequential`` (megatron's ``SequentialMLP``: one linear per expert, e.g. for LoRA on the
    experts) or ``auto`` (``grouped`` where this torch has a grouped GEMM). The two store the
    experts under different parameter names; HF checkpoints load into both."""
    init_std: float = 0.02
    """Init std of the weights."""
    mrope_section: list[int] | None = None
    """M-RoPE sizes (temporal, height, width) summing to head_dim/2 (a VLM's language model,
    HF ``rope_scaling.mrope_section``); None: 1D rotary."""
    layer_backend: str = "auto"
    """auto (Transformer Engine on CUDA when installed, else longboat kernels), longboat, te, local."""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> DecoderModelConfig:
        """The config from a composed ``model`` section (keys of other schemas ignored)."""
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})

    def architecture(self) -> dict[str, Any]:
        """The fields a checkpoint's weights fix (``ARCH_FIELDS``) with their values."""
        return {name: getattr(self, name) for name in ARCH_FIELDS}

    def validate(self, *, prefix: str = "model") -> None:
        """Raise ``ConfigError`` for inconsistent shapes, naming each key."""
        problems: list[str] = []
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "ffn_hidden_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                problems.append(f"{prefix}.{name}={value!r}: must be a positive integer")
        if problems:
            raise ConfigError("; ".join(problems))
        if self.num_attention_heads % self.num_query_groups != 0:
            problems.append(
                f"{prefix}.num_query_groups={self.num_query_groups}: must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_experts and self.moe_ffn_hidden_size is None:
            problems.append(f"{prefix}.moe_ffn_hidden_size: required when num_experts > 0")
        if self.num_experts and not 0 < self.moe_topk <= self.num_experts:
            problems.append(
                f"{prefix}.moe_topk={self.moe_topk}: must be in 1..num_experts={self.num_experts}"
            )
        if self.mrope_section is not None and (
            len(self.mrope_section) != 3 or sum(self.mrope_section) * 2 != self.head_dim
        ):
            problems.append(
                f"{prefix}.mrope_section={list(self.mrope_section)!r}: must be three sizes "
                f"(temporal, height, width) summing to head_dim/2={self.head_dim // 2}"
            )
        if problems:
            raise ConfigError("; ".join(problems))

    def validate_parallel(self, *, tp: int, pp: int, ep: int, vpp: int | None = None) -> None:
        """Check the parallel sizes fit this architecture (TP divides heads, ...).

        Raises one ``ConfigError`` carrying a problem per offending key.
        """
        problems: list[ConfigProblem] = []

        def bad(key: str, value: int, message: str, fix: str) -> None:
            problems.append(ConfigProblem(key=key, message=message, value=value, fix=fix))

        if self.num_attention_heads % tp or self.num_query_groups % tp:
            bad(
                "parallel.tensor_parallel",
                tp,
                f"must divide num_attention_heads={self.num_attention_heads} and "
                f"num_query_groups={self.num_query_groups}.",
                "use a tensor_parallel that divides both.",
            )
        if self.ffn_hidden_size % tp or (self.vocab_size % tp):
            bad(
                "parallel.tensor_parallel",
                tp,
                f"must divide ffn_hidden_size={self.ffn_hidden_size} and "
                f"vocab_size={self.vocab_size}.",
                "use a tensor_parallel that divides both (or pad the vocabulary).",
            )
        stages = pp * (vpp or 1)
        if self.num_layers % stages:
            bad(
                "parallel.pipeline_parallel",
                pp,
                f"pipeline_parallel x virtual stages ({vpp or 1}) must divide "
                f"num_layers={self.num_layers}.",
                "choose sizes whose product divides the layer count.",
            )
        if self.num_experts and self.num_experts % ep:
            bad(
                "parallel.expert_parallel",
                ep,
                f"must divide num_experts={self.num_experts}.",
                "use an expert_parallel that divides the expert count.",
            )
        if not self.num_experts and ep > 1:
            bad("parallel.expert_parallel", ep, "the model has no experts.", "set it to 1.")
        if problems:
            raise ConfigError(problems)


ARCH_FIELDS = tuple(
    f.name
    for f in fields(DecoderModelConfig)
    if f.name
    not in (
        "name",
        "flavor",
        "init_from",
        "layer_backend",
        "init_std",
        "max_position_embeddings",
        "moe_aux_loss_coeff",
        "moe_aux_loss",
        "moe_experts",
    )
)
"""The fields that describe the architecture: what a checkpoint's weights fix (the others
may differ from the checkpoint's: layer backend, init, rotary table length, aux-loss weight and kind, experts layout)."""


def unfused_layer_kwargs(dtype: Any) -> dict[str, Any]:
    """``TransformerConfig`` fields every longboat megatron model shares: no megatron fusions
    (the longboat kernels replace them), no dropout, CPU init, weights and pipeline
    activations in ``dtype`` (a torch dtype)."""
    import torch

    return dict(
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )


def to_transformer_config(
    arch: DecoderModelConfig,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_pipeline_parallel: int | None = None,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    precision: str = "fp32",
    sequence_parallel: bool = False,
    kernel_activation: bool = False,
    **overrides: Any,
) -> Any:
    """megatron-core ``TransformerConfig`` for ``arch`` under the given parallel sizes.

    ``kernel_activation``: the layer spec supplies the SwiGLU module
    (``LayerKernels.swiglu``), so megatron must call it instead of its own GLU.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch.validate()
    arch.validate_parallel(
        tp=tensor_parallel, pp=pipeline_parallel, ep=expert_parallel, vpp=virtual_pipeline_parallel
    )
    import torch
    import torch.nn.functional as F

    if precision not in _PRECISIONS:
        raise ConfigError(
            f"train.precision={precision!r}: expected one of {sorted(_PRECISIONS)}. Fix: pick one."
        )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        qk_layernorm=arch.qk_norm,
        add_bias_linear=False,
        add_qkv_bias=arch.attention_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        use_te_activation_func=kernel_activation,
        init_method_std=arch.init_std,
        autocast_dtype=dtype,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline_parallel,
        context_parallel_size=context_parallel,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=1,
        sequence_parallel=sequence_parallel,
        deallocate_pipeline_outputs=False,
        **unfused_layer_kwargs(dtype),
    )
    if arch.mrope_section is not None:
        kwargs["mrope_section"] = list(arch.mrope_section)
    if arch.num_experts:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_router_pre_softmax=not arch.moe_norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss" if arch.moe_aux_loss_coeff else "none",
            moe_aux_loss_coeff=arch.moe_aux_loss_coeff,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_dtype="fp32",
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
