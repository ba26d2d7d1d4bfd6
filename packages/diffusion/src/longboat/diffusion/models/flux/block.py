"""The FLUX.1 blocks on megatron-core's tensor-parallel modules.

Both kinds of block run on the *joint* sequence: the caption tokens first, then the image
tokens (diffusers' order), all attending to all (padded caption tokens masked out as keys).
Every block is modulated by ``vec = silu(temb)`` of its sample (timestep, pooled text and,
for guidance-distilled models, guidance embeddings summed).

**Double-stream** (diffusers' ``FluxTransformerBlock``): image and caption keep separate
weights: each stream has its own AdaLN-Zero modulation (six vectors from ``vec``), q / k / v
projections with per-head RMS qk-norm, output projection and GELU(tanh) feed-forward; only
the attention is joint::

    x += gate1 * proj(attn(adaln(x; shift1, scale1)))     (and the same for the caption c)
    x += gate2 * ffn(adaln(x; shift2, scale2))

**Single-stream** (``FluxSingleTransformerBlock``): one weight set on the joint sequence,
attention and MLP in parallel from one modulated input::

    h = adaln(x; shift, scale);  x += gate * (proj(attn(h)) + fc2(gelu_tanh(fc1(h))))

(diffusers' one ``proj_out`` over ``cat(attn, mlp)`` is the two row-parallel projections
``linear_proj`` (with the bias) and ``linear_fc2`` here, so each splits over tensor-parallel
ranks on its own input).

q / k / v, the feed-forward's first linear and the modulation linears are megatron column
parallel linears (the modulation gathers its output: every rank needs all six vectors), the
output projections row parallel. The qk-norm weight is one ``[head_dim]`` vector shared by all
heads, so under tensor parallelism its gradient is summed over the ranks' heads
(``HeadRMSNorm``). Each head's q / k channels are stored de-interleaved (even, then odd; ``diffusers.py``
permutes), so FLUX's interleaved-pair rotation runs as the half-split ``kernels.rope``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state as mps
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
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


@dataclass(frozen=True)
class JointLayout:
    """The joint (caption + image) sequence of one forward."""

    text_len: int
    """Caption tokens at the front of the sequence."""
    cos: torch.Tensor
    """fp32 ``[L + S, head_dim // 2]`` rotary cosines (1 on caption tokens: FLUX's text ids
    are zero)."""
    sin: torch.Tensor
    """fp32 ``[L + S, head_dim // 2]`` rotary sines."""
    key_mask: torch.Tensor | None
    """``[B, 1, 1, L + S]`` bool, True for keys to attend to (padded caption tokens False);
    None: all."""


def _mlp_out(mlp: Any, h: torch.Tensor) -> torch.Tensor:
    out, bias = mlp(h)
    return out if bias is None else out + bias


class HeadRMSNorm(MegatronModule):
    """RMSNorm of each head's channels with one ``[head_dim]`` weight for all heads (FLUX's
    qk-norm). Under tensor parallelism the weight is replicated and each rank sees a share of
    the heads, so its gradient is all-reduced over the TP group."""

    def __init__(
        self, config: Any, head_dim: int, eps: float, *, rms_norm: RMSNormFn = torch_rms_norm
    ) -> None:
        super().__init__(config=config)
        self.tp = mps.get_tensor_model_parallel_world_size()
        self.eps = eps
        self._rms_norm = rms_norm
        self.weight = torch.nn.Parameter(torch.ones(head_dim, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, S, H, head_dim]`` -> same shape."""
        weight = self.weight
        if self.tp > 1:  # identity forward, all-reduced gradient
            weight = copy_to_tensor_model_parallel_region(weight)
        return self._rms_norm(x, weight, self.eps)


@dataclass
class FluxBlockSubmodules:
    """The module kinds a FLUX block is built from (classes or ``ModuleSpec`` s)."""

    column: Any
    """Column-parallel linear (q / k / v, fc1, modulation)."""
    row: Any
    """Row-parallel linear (output projections, fc2)."""
    qk_norm: Any
    """Per-head RMSNorm of queries and keys."""
    mlp: Any
    """The double-stream feed-forward (megatron ``MLP``)."""


class _Stream(MegatronModule):
    """One stream's q / k / v projections and qk-norms (``added``: the caption stream of a
    double block)."""

    def __init__(self, config: Any, sub: FluxBlockSubmodules, eps: float) -> None:
        super().__init__(config=config)
        width = config.hidden_size
        self.tp = mps.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // self.tp
        self.head_dim = config.kv_channels
        # q / k / v share one all-reduce of their input's gradient (``tp_input``).
        column = dict(
            config=config, init_method=config.init_method, bias=True, gather_output=False,
            skip_bias_add=False, disable_grad_reduce=True,
        )  # fmt: skip
        self.linear_q = build_module(sub.column, width, width, **column)
        self.linear_k = build_module(sub.column, width, width, **column)
        self.linear_v = build_module(sub.column, width, width, **column)
        self.q_norm = build_module(sub.qk_norm, config, self.head_dim, eps)
        self.k_norm = build_module(sub.qk_norm, config, self.head_dim, eps)

    def tp_input(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward; backward all-reduces the gradient over the TP group."""
        return copy_to_tensor_model_parallel_region(x) if self.tp > 1 else x

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[B, S, D]`` (already through ``tp_input``) -> q, k, v ``[B, S, h, d]``."""

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (self.heads, self.head_dim))

        q = self.q_norm(heads(self.linear_q(x)[0]))
        k = self.k_norm(heads(self.linear_k(x)[0]))
        return q, k, heads(self.linear_v(x)[0])


class JointAttention(torch.nn.Module):
    """Rotary embedding and attention over the joint sequence (no parameters)."""

    def __init__(self, head_dim: int, rope: RopeFn | None, attention_fn: AttentionFn) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)
        self._rope = rope or rope_reference
        self.attention_fn = attention_fn

    def forward(self, q: Any, k: Any, v: Any, layout: JointLayout) -> torch.Tensor:
        """q / k / v ``[B, L + S, h, d]`` -> ``[B, L + S, h * d]``."""
        q, k = self._rope(q, k, layout.cos, layout.sin)
        out = self.attention_fn(q, k, v, causal=False, scale=self.scale, mask=layout.key_mask)
        return out.flatten(-2)


def _modulation(config: Any, sub: FluxBlockSubmodules, n: int) -> Any:
    """Column-parallel ``D -> n * D`` with the output gathered (each rank needs all ``n``
    vectors; the weight is split, the ``[B, n * D]`` output is tiny)."""
    width = config.hidden_size
    return build_module(
        sub.column, width, n * width, config=config, init_method=config.init_method, bias=True,
        gather_output=True, skip_bias_add=False,
    )  # fmt: skip


def _row(config: Any, sub: FluxBlockSubmodules, d_in: int, bias: bool = True) -> Any:
    return build_module(
        sub.row, d_in, config.hidden_size, config=config,
        init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True,
        skip_bias_add=False,
    )  # fmt: skip


def _vectors(mod: Any, vec: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """``n`` fp32 modulation vectors ``[B, D]`` of ``vec`` ``[B, D]``."""
    out, _ = mod(vec[:, None, :])
    return out[:, 0].float().chunk(n, dim=-1)


class _FluxBlock(MegatronModule):
    """What both block kinds share: the layer number, the norms' eps and the joint attention
    (``rope``, ``attention_fn``)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        eps: float,
        rope: RopeFn | None,
        attention_fn: AttentionFn,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.eps = eps
        self.attention = JointAttention(config.kv_channels, rope, attention_fn)


class FluxDoubleBlock(_FluxBlock):
    """A double-stream block (module doc): ``forward(x, c, vec, layout) -> (x, c)``."""

    def __init__(
        self,
        config: Any,
        submodules: FluxBlockSubmodules,
        layer_number: int,
        *,
        eps: float,
        rope: RopeFn | None = None,
        attention_fn: AttentionFn = kernel_attention,
    ) -> None:
        super().__init__(config, layer_number, eps, rope, attention_fn)
        sub, width = submodules, config.hidden_size
        self.img_mod = _modulation(config, sub, 6)
        self.txt_mod = _modulation(config, sub, 6)
        self.img_attn = _Stream(config, sub, eps)
        self.txt_attn = _Stream(config, sub, eps)
        self.img_proj = _row(config, sub, width)
        self.txt_proj = _row(config, sub, width)
        mlp = dict(config=config, ffn_hidden_size=config.ffn_hidden_size)
        self.img_mlp = build_module(sub.mlp, **mlp)
        self.txt_mlp = build_module(sub.mlp, **mlp)

    def forward(
        self, x: torch.Tensor, c: torch.Tensor, vec: torch.Tensor, layout: JointLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[B, S, D]`` image, ``c`` ``[B, L, D]`` caption, ``vec`` ``[B, D]``."""
        eps = self.eps
        shift1, scale1, gate1, shift2, scale2, gate2 = _vectors(self.img_mod, vec, 6)
        c_shift1, c_scale1, c_gate1, c_shift2, c_scale2, c_gate2 = _vectors(self.txt_mod, vec, 6)

        hx = self.img_attn.tp_input(adaln_modulate(x, shift1, scale1, eps))
        hc = self.txt_attn.tp_input(adaln_modulate(c, c_shift1, c_scale1, eps))
        qx, kx, vx = self.img_attn.qkv(hx)
        qc, kc, vc = self.txt_attn.qkv(hc)
        q, k, v = (torch.cat(pair, dim=1) for pair in ((qc, qx), (kc, kx), (vc, vx)))
        out = self.attention(q, k, v, layout)
        n = layout.text_len
        x = gated_add(x, self.img_proj(out[:, n:])[0], gate1)
        c = gated_add(c, self.txt_proj(out[:, :n])[0], c_gate1)

        h = adaln_modulate(x, shift2, scale2, eps)
        x = gated_add(x, _mlp_out(self.img_mlp, h), gate2)
        h = adaln_modulate(c, c_shift2, c_scale2, eps)
        c = gated_add(c, _mlp_out(self.txt_mlp, h), c_gate2)
        return x, c


class FluxSingleBlock(_FluxBlock):
    """A single-stream block (module doc): ``forward(h, vec, layout) -> h`` on the joint
    sequence ``[B, L + S, D]``."""

    def __init__(
        self,
        config: Any,
        submodules: FluxBlockSubmodules,
        layer_number: int,
        *,
        eps: float,
        rope: RopeFn | None = None,
        attention_fn: AttentionFn = kernel_attention,
    ) -> None:
        super().__init__(config, layer_number, eps, rope, attention_fn)
        sub, width = submodules, config.hidden_size
        self.mod = _modulation(config, sub, 3)
        self.attn = _Stream(config, sub, eps)
        self.linear_fc1 = build_module(
            sub.column, width, config.ffn_hidden_size, config=config,
            init_method=config.init_method, bias=True, gather_output=False, skip_bias_add=False,
            disable_grad_reduce=True,
        )  # fmt: skip
        self.linear_proj = _row(config, sub, width)
        self.linear_fc2 = _row(config, sub, config.ffn_hidden_size, bias=False)

    def forward(self, h: torch.Tensor, vec: torch.Tensor, layout: JointLayout) -> torch.Tensor:
        shift, scale, gate = _vectors(self.mod, vec, 3)
        n = self.attn.tp_input(adaln_modulate(h, shift, scale, self.eps))
        q, k, v = self.attn.qkv(n)
        attn = self.attention(q, k, v, layout)
        mlp = gelu_tanh(self.linear_fc1(n)[0])
        out = self.linear_proj(attn)[0] + self.linear_fc2(mlp)[0]
        return gated_add(h, out, gate)


def flux_block_specs(
    kernels: LayerKernels | None = None, attention_fn: AttentionFn = kernel_attention
) -> tuple[ModuleSpec, ModuleSpec]:
    """``ModuleSpec`` s of the double- and single-stream blocks on longboat's local megatron
    modules: megatron's column / row parallel linears and ``MLP``, ``kernels.rms_norm`` for the
    qk-norm, ``kernels.rope`` for the rotation (the torch reference when None),
    ``attention_fn`` for attention."""
    kernels = kernels or LayerKernels()
    provider = LongboatSpecProvider(kernels)
    sub = FluxBlockSubmodules(
        column=provider.column_parallel_linear(),
        row=provider.row_parallel_linear(),
        qk_norm=ModuleSpec(module=HeadRMSNorm, params={"rms_norm": kernels.rms_norm}),
        mlp=mlp_spec(provider),
    )
    params = {"rope": kernels.rope, "attention_fn": attention_fn}
    double = ModuleSpec(module=FluxDoubleBlock, params=params, submodules=sub)
    single = ModuleSpec(module=FluxSingleBlock, params=params, submodules=sub)
    return double, single


flux_transformer_config = dit_transformer_config
"""megatron ``TransformerConfig`` of the FLUX blocks (``common.layers.dit_transformer_config``;
``num_layers`` counts double- and single-stream blocks)."""
