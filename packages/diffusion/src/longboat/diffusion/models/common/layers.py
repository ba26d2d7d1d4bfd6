"""Family-neutral DiT layers on megatron-core: attention dispatch, AdaLN, the torch rotary
reference, the sinusoidal timestep embedding, the blocks' ``TransformerConfig`` and the
arguments every family's ``build`` resolves."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mps
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from longboat.core.layer_kernels import LayerKernels
from longboat.core.megatron.decoder_config import unfused_layer_kwargs
from longboat.core.megatron.specs import LongboatSpecProvider

AttentionFn = Callable[..., torch.Tensor]
"""``fn(q, k, v, *, causal, scale, cu_seqlens=None, max_seqlen=None, mask=None)``:
``longboat.kernels.attention.attention``'s contract (``[B, S, H, D]``, or packed
``[tokens, H, D]`` with ``cu_seqlens``; ``mask`` bool, True where attention is allowed)."""

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``train.precision`` -> parameter dtype."""


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
    """Attention through ``longboat.kernels.attention``'s dispatch (flash-attn varlen / cuDNN
    on GPU, SDPA on CPU)."""
    from longboat.kernels.attention import attention

    return attention(q, k, v, **kwargs)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (the feed-forward and text-embedding activation)."""
    return F.gelu(x, approximate="tanh")


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-split rotation of ``q`` / ``k`` ``[B, S, H, D]`` by per-token ``cos`` / ``sin``
    ``[S, D // 2]`` in fp32 (the ``RopeFn`` contract; used when no kernel is given)."""
    c, s = cos[:, None, :], sin[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rot(q), rot(k)


def adaln_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> Any:
    """``layer_norm(x) * (1 + scale) + shift`` (no affine; fp32 inside) through
    ``longboat.kernels.adaln``; ``x`` ``[b, s, D]``, ``shift`` / ``scale`` ``[b, D]``."""
    from longboat.kernels.adaln import ada_layer_norm

    return ada_layer_norm(x, scale, shift, eps)


def gated_add(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> Any:
    """``x + y * gate`` with the residual sum in fp32 (as diffusers; the modulation is fp32);
    ``x`` / ``y`` ``[b, s, D]``, ``gate`` ``[b, D]``. One pass over the tokens forward and one
    backward through ``longboat.kernels.gated_residual`` (its torch reference on CPU)."""
    from longboat.kernels.gated_residual import gated_residual

    return gated_residual(x, y, gate)


def empty_captions(mask: torch.Tensor) -> list[int]:
    """Rows of a ``[n, L]`` text mask with no caption token (reads the mask: call it on
    the host)."""
    return (~mask.to(torch.bool).any(dim=1)).nonzero().flatten().tolist()


def timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: float = 10000.0) -> Any:
    """fp32 ``[n, dim]`` sinusoidal embedding ``[cos(t * f), sin(t * f)]`` with frequencies
    ``f_j = max_period ** (-j / (dim / 2))`` (diffusers' ``Timesteps(flip_sin_to_cos=True,
    downscale_freq_shift=0)``)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, device=timesteps.device) / half
    angles = timesteps.float()[:, None] * torch.exp(exponent.float())[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class TwoLayerMLP(torch.nn.Module):
    """``linear_2(act(linear_1(x)))``: the time (SiLU) and text (GELU tanh) embedders."""

    def __init__(self, d_in: int, d_out: int, act: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(d_in, d_out, dtype=dtype)
        self.linear_2 = torch.nn.Linear(d_out, d_out, dtype=dtype)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class DiTMLP(MegatronModule):
    """The blocks' feed-forward: ``linear_fc2(act(linear_fc1(x)))`` on the provider's column /
    row parallel linears, each adding its bias inside its GEMM.

    megatron's ``MLP`` asks its linears to hand the biases back and adds them as kernels of
    their own (over the ``[tokens, ffn]`` activation for fc1); the parameters (``linear_fc1``
    / ``linear_fc2`` weight and bias), their initialisation and their tensor-parallel split
    are ``MLP``'s. ``forward`` returns ``(output, None)`` like ``MLP``.
    """

    def __init__(
        self,
        config: Any,
        submodules: MLPSubmodules,
        ffn_hidden_size: int | None = None,
        **unused: Any,
    ) -> None:
        super().__init__(config=config)
        ffn = ffn_hidden_size or config.ffn_hidden_size
        self.linear_fc1 = build_module(
            submodules.linear_fc1, config.hidden_size, ffn, config=config,
            init_method=config.init_method, gather_output=False, bias=config.add_bias_linear,
            skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1",
        )  # fmt: skip
        self.activation_func = config.activation_func
        self.linear_fc2 = build_module(
            submodules.linear_fc2, ffn, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="fc2",
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        out, _ = self.linear_fc2(self.activation_func(self.linear_fc1(x)[0]))
        return out, None


def mlp_spec(provider: LongboatSpecProvider) -> ModuleSpec:
    """``DiTMLP`` (fc1 -> ``config.activation_func`` -> fc2, biases in the GEMMs) on the
    provider's column / row parallel linears."""
    return ModuleSpec(
        module=DiTMLP,
        submodules=MLPSubmodules(
            linear_fc1=provider.column_parallel_linear(),
            linear_fc2=provider.row_parallel_linear(),
        ),
    )


class DiTShape(Protocol):
    """What ``dit_transformer_config`` reads of a family config."""

    num_blocks: int
    hidden_size: int
    ffn_dim: int
    num_attention_heads: int
    attention_head_dim: int
    eps: float

    def validate(self, *, prefix: str = ...) -> None: ...

    def validate_parallel(
        self, *, tensor_parallel: int, context_parallel: int = ..., prefix: str = ...
    ) -> None: ...


def dit_transformer_config(
    cfg: DiTShape,
    *,
    tensor_parallel: int | None = None,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Any:
    """megatron ``TransformerConfig`` of a family's blocks (``tensor_parallel``: the live
    megatron TP size when None), after the config's own and parallel checks. Biased linears,
    GELU(tanh) feed-forward, Xavier-uniform weights with zero biases."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg.validate()
    if tensor_parallel is None:
        tensor_parallel = mps.get_tensor_model_parallel_world_size()
    context_parallel = max(1, mps.get_context_parallel_world_size()) if mps.is_initialized() else 1
    cfg.validate_parallel(tensor_parallel=tensor_parallel, context_parallel=context_parallel)
    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_blocks,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_dim,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_attention_heads,
        kv_channels=cfg.attention_head_dim,
        layernorm_epsilon=cfg.eps,
        add_bias_linear=True,
        add_qkv_bias=True,
        gated_linear_unit=False,
        activation_func=gelu_tanh,
        init_method=torch.nn.init.xavier_uniform_,
        output_layer_init_method=torch.nn.init.xavier_uniform_,
        tensor_model_parallel_size=tensor_parallel,
        **unfused_layer_kwargs(params_dtype),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_options(precision: str, kernels: LayerKernels | None) -> tuple[torch.dtype, LayerKernels]:
    """The parameter dtype of ``precision`` (``ConfigError`` naming ``train.precision``
    otherwise) and ``kernels``, by default ``longboat.kernels``' RMSNorm and RoPE kernels."""
    from longboat.core.config.errors import ConfigError

    if precision not in PRECISIONS:
        raise ConfigError(
            "unknown precision", key="train.precision", value=precision,
            fix=f"use one of {sorted(PRECISIONS)}",
        )  # fmt: skip
    return PRECISIONS[precision], kernels if kernels is not None else dit_layer_kernels()


def dit_layer_kernels(fp8: str | None = None) -> LayerKernels:
    """The layer kernels a DiT's blocks run on: ``longboat.kernels``' attention, RMSNorm and
    RoPE (no SwiGLU, fused QKV split or residual-add norm: the blocks have none of those);
    ``fp8``: an FP8 recipe for the blocks' linears (``train.precision=fp8``)."""
    from longboat.kernels.layers import longboat_layer_kernels

    return longboat_layer_kernels(swiglu=False, qkv_rope=False, add_rms_norm=False, fp8=fp8)


__all__ = [
    "PRECISIONS",
    "AttentionFn",
    "DiTMLP",
    "DiTShape",
    "TwoLayerMLP",
    "adaln_modulate",
    "build_options",
    "dit_layer_kernels",
    "dit_transformer_config",
    "empty_captions",
    "gated_add",
    "gelu_tanh",
    "kernel_attention",
    "mlp_spec",
    "rope_reference",
    "timestep_embedding",
]
