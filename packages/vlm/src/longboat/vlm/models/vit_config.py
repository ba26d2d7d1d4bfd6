"""The megatron ``TransformerConfig`` of a ViT's blocks, shared by the towers (Qwen2.5-VL,
Qwen3-VL, SigLIP): each tower names its widths, norm and activation; the tensor-parallel
check and megatron's settings for unfused bias-carrying blocks are the same for all."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from longboat.core.config.errors import ConfigError


def vit_transformer_config(
    *,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    head_dim: int,
    normalization: str,
    norm_eps: float,
    gated: bool,
    activation_func: Callable[..., torch.Tensor],
    tensor_parallel: int,
    params_dtype: torch.dtype,
    **overrides: Any,
) -> Any:
    """megatron ``TransformerConfig`` of ViT blocks (full multi-head attention, biases on
    every linear) sharded over ``tensor_parallel`` ranks, which must divide the heads and the
    MLP width; ``overrides`` replace any setting."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from longboat.core.megatron.decoder_config import unfused_layer_kwargs

    for key, value in (("num_heads", num_heads), ("intermediate_size", intermediate_size)):
        if value % tensor_parallel:
            raise ConfigError(
                f"is not divisible by tensor_parallel={tensor_parallel}",
                key=f"model.vision.{key}",
                value=value,
                fix="pick a parallel.tensor_parallel that divides it",
            )
    kwargs: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=intermediate_size,
        num_attention_heads=num_heads,
        num_query_groups=num_heads,
        kv_channels=head_dim,
        normalization=normalization,
        layernorm_epsilon=norm_eps,
        add_bias_linear=True,
        add_qkv_bias=True,
        gated_linear_unit=gated,
        activation_func=activation_func,
        tensor_model_parallel_size=tensor_parallel,
        **unfused_layer_kwargs(params_dtype),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def gelu_activation(hidden_act: str) -> Callable[..., torch.Tensor]:
    """GELU as HF's ``hidden_act`` names it: ``gelu_pytorch_tanh`` (tanh approximation) or
    ``gelu`` (exact)."""
    approximate = "tanh" if hidden_act == "gelu_pytorch_tanh" else "none"
    return partial(torch.nn.functional.gelu, approximate=approximate)
