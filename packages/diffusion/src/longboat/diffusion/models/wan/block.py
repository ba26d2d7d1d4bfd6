"""The Wan transformer block on megatron-core's tensor-parallel modules.

One block (diffusers' ``WanTransformerBlock``), on tokens ``x`` ``[B, S, D]`` (batch-first):

1. ``x += gate1 * self_attn(adaln(x; shift1, scale1))``: LayerNorm without affine, modulated
   per sample; q / k RMS-normalised over all heads' channels, rotated by the 3D rotary
   embedding; bidirectional attention inside each sample.
2. ``x += cross_attn(norm2(x), text)``: affine LayerNorm (``cross_attn_norm``); queries from the
   video tokens, keys / values from the projected text embeddings (RMS-normed keys), padded
   text tokens masked out.
3. ``x += gate2 * mlp(adaln(x; shift2, scale2))``: GELU(tanh) feed-forward (megatron's ``MLP``).

The six modulation vectors of a sample are the block's ``scale_shift_table`` ``[1, 6, D]`` plus
the model's time projection of that sample's timestep ``[6, D]``, in fp32 (as diffusers).

Megatron's ``TransformerLayer`` has no slot for the per-sample modulation, so ``WanBlock`` is
its own ``MegatronModule`` built from a ``ModuleSpec`` (``wan_block_spec``): q / k / v /
output projections are megatron's column / row parallel linears from core's
``LongboatSpecProvider``, the feed-forward is megatron's ``MLP``, so tensor parallelism
splits the heads and the FFN width as megatron does. The qk-norm spans all heads, so under
tensor parallelism its sum of squares is all-reduced over the TP group (``HeadsRMSNorm``).

Token layouts (``TokenLayout``): *dense*, ``B`` samples of one grid, attention per batch row;
or *packed*, ``B = 1`` and ``S`` the tokens of several samples one after another, with
``cu_seqlens`` keeping self-attention inside each sample, per-sample modulation applied to
each sample's token range, and each sample's queries attending to its own caption. Under
context parallelism (``TokenLayout.shard``) a rank holds a contiguous slice of either layout's
tokens; everything but self-attention runs on the slice, self-attention exchanges slices for
head groups (``longboat.diffusion.parallel.ulysses``).

The query / key channels of each head are stored de-interleaved (the even channels of a
diffusers head, then its odd ones; ``diffusers.py`` permutes on load and export), so Wan's
interleaved-pair rotation becomes the half-split rotation of ``longboat.kernels.rope``; the
dot products, hence the outputs, are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state as mps
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from longboat.core.layer_kernels import LayerKernels, RMSNormFn, RopeFn, torch_rms_norm
from longboat.core.megatron.specs import LongboatSpecProvider
from longboat.diffusion.models.common.layers import (
    AttentionFn,
    adaln_modulate,
    dit_transformer_config,
    gated_add,
    gelu_tanh,
    kernel_attention,
    mlp_spec,
    rope_reference,
)
from longboat.diffusion.models.wan.packing import VideoPacking
from longboat.diffusion.parallel.ulysses import ContextShard, heads_to_seq, seq_to_heads

FP32_PARAMETERS = ("scale_shift_table", "q_norm", "k_norm", "cross_attn_norm")
"""Parameters kept in fp32 when the model trains in bf16 / fp16: the modulation tables and the
norms' weights. They feed fp32 arithmetic (the modulation sum, the norms' statistics and
scale), as in a model of fp32 weights under autocast (and diffusers' ``_keep_in_fp32_modules``
for the tables and the cross-attention norm); in bf16 their small updates would be rounded
away and their values coarsened for no saving (a few hundred KB)."""


@dataclass(frozen=True)
class TokenLayout:
    """How the tokens of one forward are laid out (see the module doc)."""

    packing: VideoPacking | None
    """None: dense ``[B, S, D]`` (one grid for all samples); else the packed samples."""
    cos: torch.Tensor
    """fp32 ``[S, head_dim // 2]`` rotary cosines of the tokens."""
    sin: torch.Tensor
    """fp32 ``[S, head_dim // 2]`` rotary sines."""
    text_mask: torch.Tensor | None
    """``[samples, L]`` bool, True for caption tokens to attend to; None: all of them."""
    shard: ContextShard | None = None
    """Context parallelism: the slice of the tokens this rank holds (``x``, ``cos``, ``sin``
    are that slice); self-attention gathers the sequence per head group (Ulysses)."""
    segments: tuple[int, ...] | None = None
    """Packed: tokens of each sample among this rank's tokens (None: ``packing.seqlens``)."""

    @property
    def segmented(self) -> bool:
        """Whether per-sample quantities apply to token ranges (more than one packed sample)."""
        return self.packing is not None and self.packing.num_samples > 1

    @property
    def segment_lengths(self) -> tuple[int, ...]:
        """Tokens of each packed sample held here (zero for a sample outside this rank's
        slice)."""
        assert self.packing is not None
        return self.segments if self.segments is not None else tuple(self.packing.seqlens)


def per_sample(
    fn: Callable[..., torch.Tensor],
    tokens: tuple[torch.Tensor, ...],
    vectors: tuple[torch.Tensor, ...],
    layout: TokenLayout,
) -> torch.Tensor:
    """``fn(*tokens, *vectors)`` with each sample's vectors ``[n, ...]`` meeting its tokens.

    Dense (or one packed sample): one call, vectors ``[B, ...]`` against tokens ``[B, S, ...]``.
    Packed: one call per sample on its token range (views of the ``[1, S, ...]`` tokens), the
    results concatenated, so no per-token copy of the vectors is ever materialised.
    """
    if not layout.segmented:
        return fn(*tokens, *vectors)
    lengths = layout.segment_lengths
    parts = [t.split(lengths, dim=1) for t in tokens]
    outs = [
        fn(*(p[i] for p in parts), *(v[i : i + 1] for v in vectors))
        for i, n in enumerate(lengths)
        if n > 0  # a sample outside this rank's context-parallel slice
    ]
    return torch.cat(outs, dim=1)


# -- norms ------------------------------------------------------------------------------------


class HeadsRMSNorm(MegatronModule):
    """RMSNorm over all heads' channels of a column-parallel projection (Wan's qk-norm).

    The weight is split over the TP ranks like the projection's rows; under tensor
    parallelism each rank's sum of squares is all-reduced (forward and backward: every rank's
    output depends on every rank's channels). The weight is fp32 in every precision (see
    ``FP32_PARAMETERS``).
    """

    def __init__(
        self, config: Any, hidden_size: int, eps: float, *, rms_norm: RMSNormFn = torch_rms_norm
    ) -> None:
        super().__init__(config=config)
        self.tp = mps.get_tensor_model_parallel_world_size()
        self.full_width = hidden_size
        self.eps = eps
        self._rms_norm = rms_norm
        local = hidden_size // self.tp
        self.weight = torch.nn.Parameter(torch.ones(local, dtype=torch.float32))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return self._rms_norm(x, self.weight, self.eps)
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        # all-reduce forward (reduce_from) and backward (copy_to)
        squares = reduce_from_tensor_model_parallel_region(
            copy_to_tensor_model_parallel_region(squares)
        )
        y = xf * torch.rsqrt(squares / self.full_width + self.eps)
        return (self.weight.float() * y).to(x.dtype)


class AffineLayerNorm(torch.nn.Module):
    """LayerNorm with weight and bias, statistics in fp32 (``cross_attn_norm``); the weight and
    bias are fp32 in every precision (see ``FP32_PARAMETERS``)."""

    def __init__(self, config: Any, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Any:
        from longboat.kernels.layernorm import layer_norm

        return layer_norm(x, self.weight, self.bias, self.eps)


# -- attention --------------------------------------------------------------------------------


@dataclass
class WanAttentionSubmodules:
    """Modules of one Wan attention (each a class or ``ModuleSpec``)."""

    linear_q: Any
    linear_k: Any
    linear_v: Any
    linear_proj: Any
    q_norm: Any
    k_norm: Any


class WanAttention(MegatronModule):
    """Multi-head attention of a Wan block: self-attention with the 3D rotary embedding, or
    (``cross=True``) attention of the video tokens to the caption tokens."""

    def __init__(
        self,
        config: Any,
        submodules: WanAttentionSubmodules,
        *,
        cross: bool,
        eps: float,
        rope: RopeFn | None = None,
        attention_fn: AttentionFn = kernel_attention,
    ) -> None:
        super().__init__(config=config)
        width = config.hidden_size
        tp = mps.get_tensor_model_parallel_world_size()
        self.cross = cross
        self.heads = config.num_attention_heads // tp
        self.head_dim = config.kv_channels
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self._rope = rope or rope_reference
        self.attention_fn = attention_fn
        # The q / k / v projections of one input share one all-reduce of its gradient
        # (``_tp_input``) instead of one each.
        self.tp = tp
        column = dict(
            config=config, init_method=config.init_method, bias=True, gather_output=False,
            skip_bias_add=False, disable_grad_reduce=True,
        )  # fmt: skip
        self.linear_q = build_module(submodules.linear_q, width, width, **column)
        self.linear_k = build_module(submodules.linear_k, width, width, **column)
        self.linear_v = build_module(submodules.linear_v, width, width, **column)
        self.q_norm = build_module(submodules.q_norm, config, width, eps)
        self.k_norm = build_module(submodules.k_norm, config, width, eps)
        self.linear_proj = build_module(
            submodules.linear_proj, width, width, config=config,
            init_method=config.output_layer_init_method, bias=True, input_is_parallel=True,
            skip_bias_add=False,
        )  # fmt: skip

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim))

    def _tp_input(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward; backward all-reduces the gradient over the TP group."""
        return copy_to_tensor_model_parallel_region(x) if self.tp > 1 else x

    def forward(
        self, x: torch.Tensor, layout: TokenLayout, text: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` ``[B, S, D]`` (``text`` ``[n, L, D]`` for cross-attention) -> ``[B, S, D]``."""
        x = self._tp_input(x)
        q = self._heads(self.q_norm(self.linear_q(x)[0]))
        source = self._tp_input(text) if self.cross else x
        assert source is not None, "cross-attention needs the text tokens"
        k = self._heads(self.k_norm(self.linear_k(source)[0]))
        v = self._heads(self.linear_v(source)[0])
        if self.cross:
            out = self._cross(q, k, v, layout)
        else:
            q, k = self._rope(q, k, layout.cos, layout.sin)
            out = self._self(q, k, v, layout)
        out, _ = self.linear_proj(out.flatten(-2))
        return out

    def _self(self, q: Any, k: Any, v: Any, layout: TokenLayout) -> torch.Tensor:
        shard = layout.shard
        if shard is None:
            return self._attend(q, k, v, layout)
        # Ulysses: the full sequence for heads / cp of the heads, attention, back to slices.
        q, k, v = (seq_to_heads(t, shard) for t in (q, k, v))
        return heads_to_seq(self._attend(q, k, v, layout), shard)

    def _attend(self, q: Any, k: Any, v: Any, layout: TokenLayout) -> torch.Tensor:
        if layout.packing is None:
            return self.attention_fn(q, k, v, causal=False, scale=self.scale)
        p = layout.packing
        out = self.attention_fn(
            q[0], k[0], v[0], causal=False, scale=self.scale, cu_seqlens=p.cu_seqlens,
            max_seqlen=p.max_seqlen,
        )  # fmt: skip
        return out.unsqueeze(0)

    def _cross(self, q: Any, k: Any, v: Any, layout: TokenLayout) -> torch.Tensor:
        mask = layout.text_mask

        def attend(qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor, mi: Any) -> Any:
            m = None if mi is None else mi[:, None, None, :]  # [b, 1, 1, L]: keys allowed
            return self.attention_fn(qi, ki, vi, causal=False, scale=self.scale, mask=m)

        if not layout.segmented:
            return attend(q, k, v, mask)
        parts = q.split(layout.segment_lengths, dim=1)
        outs = []
        for i, qi in enumerate(parts):
            if qi.shape[1] == 0:  # the sample has no token in this rank's slice
                continue
            mi = None if mask is None else mask[i : i + 1]
            outs.append(attend(qi, k[i : i + 1], v[i : i + 1], mi))
        return torch.cat(outs, dim=1)


# -- block ------------------------------------------------------------------------------------


@dataclass
class WanBlockSubmodules:
    """Modules of one Wan block."""

    self_attention: Any
    cross_attention: Any
    mlp: Any


class WanBlock(MegatronModule):
    """One Wan transformer block (see the module doc): ``forward(x, text, time_proj, layout)``."""

    def __init__(
        self,
        config: Any,
        submodules: WanBlockSubmodules,
        layer_number: int,
        *,
        cross_attn_norm: bool,
        eps: float,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.eps = eps
        width = config.hidden_size
        self.self_attention = build_module(submodules.self_attention, config=config, eps=eps)
        self.cross_attn_norm = AffineLayerNorm(config, width, eps) if cross_attn_norm else None
        self.cross_attention = build_module(submodules.cross_attention, config=config, eps=eps)
        self.mlp = build_module(
            submodules.mlp, config=config, ffn_hidden_size=config.ffn_hidden_size
        )
        table = torch.randn(1, 6, width) / math.sqrt(width)
        self.scale_shift_table = torch.nn.Parameter(table)  # fp32: see FP32_PARAMETERS

    def forward(
        self, x: torch.Tensor, text: torch.Tensor, time_proj: torch.Tensor, layout: TokenLayout
    ) -> torch.Tensor:
        """``x`` ``[B, S, D]``, ``text`` ``[n, L, D]``, ``time_proj`` ``[n, 6, D]`` -> ``[B, S, D]``."""
        mod = self.scale_shift_table.float() + time_proj.float()
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.unbind(1)
        eps = self.eps

        h = per_sample(lambda t, a, b: adaln_modulate(t, a, b, eps), (x,), (shift1, scale1), layout)
        x = per_sample(gated_add, (x, self.self_attention(h, layout)), (gate1,), layout)

        h = x if self.cross_attn_norm is None else self.cross_attn_norm(x)
        x = x + self.cross_attention(h, layout, text=text)

        h = per_sample(lambda t, a, b: adaln_modulate(t, a, b, eps), (x,), (shift2, scale2), layout)
        out, bias = self.mlp(h)
        if bias is not None:
            out = out + bias
        return per_sample(gated_add, (x, out), (gate2,), layout)


def wan_block_spec(
    kernels: LayerKernels | None = None, attention_fn: AttentionFn = kernel_attention
) -> ModuleSpec:
    """``ModuleSpec`` of a Wan block on longboat's local megatron modules: megatron's column /
    row parallel linears, ``kernels.rms_norm`` for the qk-norm (at TP 1), ``kernels.rope`` for
    the rotation (the torch reference when None), ``attention_fn`` for attention."""
    kernels = kernels or LayerKernels()
    provider = LongboatSpecProvider(kernels)
    norm = ModuleSpec(module=HeadsRMSNorm, params={"rms_norm": kernels.rms_norm})

    def attention(cross: bool) -> ModuleSpec:
        return ModuleSpec(
            module=WanAttention,
            params={"cross": cross, "rope": kernels.rope, "attention_fn": attention_fn},
            submodules=WanAttentionSubmodules(
                linear_q=provider.column_parallel_linear(),
                linear_k=provider.column_parallel_linear(),
                linear_v=provider.column_parallel_linear(),
                linear_proj=provider.row_parallel_linear(),
                q_norm=norm,
                k_norm=norm,
            ),
        )

    return ModuleSpec(
        module=WanBlock,
        submodules=WanBlockSubmodules(
            self_attention=attention(cross=False),
            cross_attention=attention(cross=True),
            mlp=mlp_spec(provider),
        ),
    )


wan_transformer_config = dit_transformer_config
"""megatron ``TransformerConfig`` of the Wan blocks (``common.layers.dit_transformer_config``;
Linears start Xavier-uniform with zero biases, as Wan initialises)."""

__all__ = [
    "FP32_PARAMETERS",
    "AffineLayerNorm",
    "AttentionFn",
    "HeadsRMSNorm",
    "TokenLayout",
    "WanAttention",
    "WanAttentionSubmodules",
    "WanBlock",
    "WanBlockSubmodules",
    "adaln_modulate",
    "gelu_tanh",
    "kernel_attention",
    "per_sample",
    "rope_reference",
    "wan_block_spec",
    "wan_transformer_config",
]
