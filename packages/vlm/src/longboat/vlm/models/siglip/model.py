"""SigLIP vision tower on megatron-core layers.

Crops ``[n, C, S, S]`` -> conv patch embedding + learned position embedding -> pre-LayerNorm
blocks (megatron ``TransformerLayer`` s: bidirectional multi-head attention and a GELU MLP,
every linear with a bias) -> ``[n, (S/p)**2, hidden]``. The crops are packed into one
sequence with one segment per crop, so attention runs through ``longboat.kernels``' varlen
dispatch (flash-attn / cuDNN on GPU, SDPA with a document mask on CPU) whatever the number of
crops. Tensor parallelism of the blocks is megatron's; the patch and position embeddings are
replicated.

``forward(pixels, layers=k)`` returns the hidden states after the first ``k`` blocks (all
by default): a VLM that reads an earlier layer's features runs only what it needs. The
final LayerNorm of the released towers is not part of the model: LLaVA-style VLMs read the
blocks' output before it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from longboat.core.megatron.specs import LayerKernels, LongboatSpecProvider
from longboat.vlm.models.qwen2_5_vl.vision import VarlenCoreAttention, kernel_varlen_attention
from longboat.vlm.models.siglip.config import SiglipVisionConfig
from longboat.vlm.models.vit_config import gelu_activation, vit_transformer_config


def siglip_layer_spec(kernels: LayerKernels | None = None) -> ModuleSpec:
    """``TransformerLayer`` spec of a SigLIP block: LayerNorms, bidirectional varlen
    attention, a plain (non-gated) MLP."""
    provider = LongboatSpecProvider(kernels or LayerKernels())
    norm = provider.layer_norm(rms_norm=False)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=provider.column_parallel_linear(),
                    core_attention=ModuleSpec(
                        module=VarlenCoreAttention,
                        params={"attention_fn": kernel_varlen_attention},
                    ),
                    linear_proj=provider.row_parallel_linear(),
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=get_mlp_module_spec_for_backend(
                backend=provider,
                num_experts=None,
                moe_grouped_gemm=False,
                use_te_activation_func=False,
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def siglip_transformer_config(
    cfg: SiglipVisionConfig, *, params_dtype: torch.dtype = torch.float32, **overrides: Any
) -> Any:
    """megatron ``TransformerConfig`` of the tower's blocks (the live megatron TP size)."""
    from megatron.core import parallel_state as mps

    cfg.validate()
    return vit_transformer_config(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        normalization="LayerNorm",
        norm_eps=cfg.layer_norm_eps,
        gated=False,
        activation_func=gelu_activation(cfg.hidden_act),
        tensor_parallel=mps.get_tensor_model_parallel_world_size(),
        params_dtype=params_dtype,
        **overrides,
    )


def _run_layer(layer: Any, x: torch.Tensor, params: PackedSeqParams) -> torch.Tensor:
    out, _ = layer(x, attention_mask=None, packed_seq_params=params)
    return out


class SiglipVisionModel(MegatronModule):
    """``forward(pixel_values [n, C, S, S]) -> [n, (S/p)**2, hidden]`` (megatron parallel
    state first: ``longboat.core.megatron.parallel_state.initialize``)."""

    def __init__(
        self,
        cfg: SiglipVisionConfig,
        *,
        params_dtype: torch.dtype = torch.float32,
        kernels: LayerKernels | None = None,
    ) -> None:
        config = siglip_transformer_config(cfg, params_dtype=params_dtype)
        super().__init__(config=config)
        self.cfg = cfg
        self.patch_embed = torch.nn.Conv2d(
            cfg.in_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
            stride=cfg.patch_size, dtype=params_dtype,
        )  # fmt: skip
        self.position_embedding = torch.nn.Parameter(
            torch.randn(cfg.num_patches, cfg.hidden_size, dtype=params_dtype) * 0.02
        )
        spec = siglip_layer_spec(kernels)
        self.layers = torch.nn.ModuleList(
            build_module(spec, config=config, layer_number=i + 1) for i in range(cfg.num_layers)
        )
        self.recompute = False
        """Recompute each block's activations in the backward instead of keeping them."""

    def forward(self, pixel_values: torch.Tensor, *, layers: int | None = None) -> torch.Tensor:
        """Hidden states after the first ``layers`` blocks (default all), ``[n, tokens, D]``."""
        cfg = self.cfg
        want = (pixel_values.dim(), *pixel_values.shape[1:])
        if want != (4, cfg.in_channels, cfg.image_size, cfg.image_size):
            raise ValueError(
                f"pixel_values must be [crops, {cfg.in_channels}, {cfg.image_size}, "
                f"{cfg.image_size}], got {tuple(pixel_values.shape)}"
            )
        n, length = pixel_values.shape[0], cfg.num_patches
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        x = x.flatten(2).transpose(1, 2) + self.position_embedding  # [n, L, D]
        x = x.reshape(n * length, 1, cfg.hidden_size)
        cu = torch.arange(0, n + 1, device=x.device, dtype=torch.int32) * length
        params = PackedSeqParams(
            qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=length,
            max_seqlen_kv=length,
        )  # fmt: skip
        for layer in self.layers[: cfg.num_layers if layers is None else layers]:
            if self.recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    _run_layer, layer, x, params, use_reentrant=False
                )
            else:
                x = _run_layer(layer, x, params)
        return x.reshape(n, length, cfg.hidden_size)
