"""The decoder model config every Megatron stack shares: a ``ModelConfig`` holding a
decoder-only LM architecture (the language model of an LLM, or of a VLM)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from longboat.core.config.schema import ModelConfig
from longboat.core.megatron.decoder_config import DecoderArch


@dataclass
class DecoderModelConfig(ModelConfig):
    """A decoder-only LM (Llama / Qwen / MoE families); defaults are the llama3 tiny flavor."""

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

    def to_arch(self) -> DecoderArch:
        """The backend-neutral architecture core.megatron builds from (the shared fields)."""
        return DecoderArch(**{f.name: getattr(self, f.name) for f in fields(DecoderArch)})


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
