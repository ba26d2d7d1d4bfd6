"""The LLM model config: a ``ModelConfig`` holding a decoder architecture."""

from __future__ import annotations

from dataclasses import dataclass

from longboat.core.config.schema import ModelConfig
from longboat.core.megatron.decoder_config import DecoderArch


@dataclass
class LLMModelConfig(ModelConfig):
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
    init_std: float = 0.02
    """Init std of the weights."""
    layer_backend: str = "auto"
    """auto (Transformer Engine on CUDA when installed, else longboat kernels), longboat, te, local."""

    def to_arch(self) -> DecoderArch:
        """The backend-neutral architecture core.megatron builds from."""
        return DecoderArch(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            head_dim=self.head_dim,
            ffn_hidden_size=self.ffn_hidden_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rope_scaling_factor=self.rope_scaling_factor,
            norm_eps=self.norm_eps,
            qk_norm=self.qk_norm,
            attention_bias=self.attention_bias,
            tie_embeddings=self.tie_embeddings,
            num_experts=self.num_experts,
            moe_topk=self.moe_topk,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_norm_topk_prob=self.moe_norm_topk_prob,
            moe_aux_loss_coeff=self.moe_aux_loss_coeff,
            init_std=self.init_std,
        )
