"""The kernel bundle a decoder layer runs on (``LayerKernels``) and its pure-torch defaults.

longboat.core may not import longboat.kernels (kernels sits above core), so core's layer
specs take their compute kernels as a ``LayerKernels``; ``longboat.kernels.layers`` builds
the bundle of longboat's kernels, and without it the torch references here are used. No
megatron import: the kernels package builds the bundle without pulling megatron.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

AttentionFn = Callable[..., torch.Tensor]
"""``fn(q, k, v, *, causal, scale, mask=None, cu_seqlens=None)`` on ``[batch, seq, heads,
head_dim]`` (k/v may have fewer, grouped heads); ``mask`` is bool, True where attention is
allowed; ``cu_seqlens`` (int32 ``[docs + 1]``, batch 1): packed documents that attend only
inside themselves. This is ``longboat.kernels.attention.attention``'s contract."""
GLUFn = Callable[[torch.Tensor], torch.Tensor]
"""``fn(x)`` = ``silu(x[..., :n]) * x[..., n:]`` for the packed ``[gate, up]`` fc1 output."""
RMSNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""``fn(x, weight, eps)`` over the last dimension."""
AddRMSNormFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]
"""``fn(x, residual, weight, eps) -> (normed, new_residual)``: ``new_residual = x + residual``
in the residual's dtype (an fp32 stream stays fp32), ``normed`` its RMSNorm times ``weight`` in
x's dtype; gradients flow to ``x`` / ``residual`` from both outputs. This is
``longboat.kernels.rmsnorm.add_rmsnorm``'s contract."""
RopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``fn(q, k, cos, sin) -> (q, k)``: rotate ``q`` / ``k`` ``[batch, seq, heads, head_dim]`` (k with
its own, grouped head count; strided views allowed) by the half-split (NeoX / Llama) rotation,
``cos`` / ``sin`` ``[seq, rotary_dim // 2]`` fp32, channels past ``rotary_dim`` passed through.
This is ``longboat.kernels.rope.apply_rope``'s contract (positions ``0..seq-1``)."""
QKVRopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""``fn(mixed, groups, q_per_group, cos, sin) -> (q, k, v)``: split megatron's fused QKV output
``mixed`` ``[s, b, groups * (q_per_group + 2) * head_dim]`` (each group's query heads, then its
key head, then its value head) into ``q`` ``[s, b, groups * q_per_group, head_dim]`` and ``k``,
``v`` ``[s, b, groups, head_dim]``, rotating q and k as ``RopeFn`` does (positions ``0..s-1``)."""

LinearFn = Callable[..., torch.Tensor]
"""``fn(x, weight, bias, *, wgrad_hook=None, wgrad_dtype=None) -> y``: ``x @ weight^T + bias``
(``x`` ``[..., in]``, ``weight`` ``[out, in]``) whose backward hands the weight gradient (in
``wgrad_dtype``, default the weight's) to ``wgrad_hook`` where one is given and gives autograd
what the hook returns. This is ``longboat.kernels.fp8.fp8_linear``'s contract (FP8 GEMMs)."""
GLULinearFn = Callable[..., torch.Tensor]
"""``fn(h, weight, bias, *, wgrad_hook=None, wgrad_dtype=None) -> y``: ``LinearFn`` of
``silu(h[..., :n]) * h[..., n:]`` for the packed ``[gate, up]`` fc1 output ``h`` (``weight``
``[out, n]``), the activation fused into the linear. This is
``longboat.kernels.fp8.glu_linear.fp8_glu_linear``'s contract (the SwiGLU written straight as
the FP8 operands)."""
GroupedLinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``fn(x, weight, tokens_per_expert) -> y``: every MoE expert's ``x_e @ weight[e]^T`` (``x``
``[T, in]`` with its rows sorted by expert, ``tokens_per_expert`` ``[E]`` rows each on the host
or the device, ``weight`` ``[E, out, in]``), differentiable in ``x`` and ``weight``. This is
``longboat.kernels.fp8.grouped.fp8_grouped_linear``'s contract (FP8 expert GEMMs)."""


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference attention: torch SDPA (flash / cuDNN / math chosen by torch); packed
    documents (``cu_seqlens``) through their dense block-diagonal mask."""
    if cu_seqlens is not None:
        bounds = cu_seqlens.to(device=q.device, dtype=torch.long)
        doc = torch.bucketize(torch.arange(q.shape[1], device=q.device), bounds[1:], right=True)
        mask = doc[:, None] == doc[None, :]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # -> [b, h, s, d]
    if mask is not None and causal:
        causal_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
        mask = mask & causal_mask.tril()
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.transpose(1, 2)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm, computed in fp32 like Hugging Face's Llama / Qwen."""
    dtype = x.dtype
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * y.to(dtype)


@dataclass(frozen=True)
class LayerKernels:
    """The compute kernels a longboat layer spec plugs into megatron's modules."""

    attention: AttentionFn = sdpa_attention
    """Core attention (``AttentionFn`` contract)."""
    rms_norm: RMSNormFn = torch_rms_norm
    """RMSNorm of the layer norms and the qk-norms."""
    add_rms_norm: AddRMSNormFn | None = None
    """Residual add + RMSNorm in one call (``AddRMSNormFn``): the layer becomes
    ``AddNormTransformerLayer``, which hands the attention output and the residual to the
    pre-MLP norm instead of adding them first (megatron's ``self_attn_bda``); None keeps
    megatron's add, then ``rms_norm``."""
    swiglu: GLUFn | None = None
    """Fused SwiGLU on the packed fc1 output; None keeps megatron's own ``silu(g) * u``.
    When set, the TransformerConfig must have ``use_te_activation_func=True`` (megatron's
    switch for "the spec supplies the activation module"); ``to_transformer_config`` does
    that given ``kernel_activation=True``."""
    rope: RopeFn | None = None
    """Rotary embedding of q and k in one call (``RopeFn`` contract); None keeps megatron's own
    ``apply_rotary_pos_emb`` (two calls, cos/sin recomputed and cast to the activation dtype)."""
    qkv_rope: QKVRopeFn | None = None
    """QKV split + rotation in one call (``QKVRopeFn``), used instead of megatron's split views
    and ``rope`` where the layer allows it (no qk-norm between split and rotation, no gated
    attention, KV groups >= TP size); None: split, then ``rope``."""
    linear: LinearFn | None = None
    """The GEMMs of the decoder layers' attention and MLP linears (``LinearFn``; e.g. FP8,
    ``longboat_layer_kernels(fp8=...)``); None keeps megatron's. The first and last layers,
    the LM head and the router keep megatron's in any case."""
    grouped_linear: GroupedLinearFn | None = None
    """The GEMMs of the grouped MoE experts (``GroupedLinearFn``; e.g. FP8 with per-expert
    scales, ``longboat_layer_kernels(fp8=...)``); None keeps the bf16 grouped GEMM. The first
    and last layers' experts keep it in any case."""
    glu_linear: GLULinearFn | None = None
    """The MLP down projection with the SwiGLU of its packed input fused in (``GLULinearFn``;
    e.g. FP8 blockwise, whose SwiGLU writes the FP8 operands instead of a bf16 activation),
    used by ``KernelMLP`` where the down projection runs on ``linear`` and the activation is
    ``swiglu`` (so both must be set); None, or a layer kept on megatron's GEMMs: ``swiglu``,
    then the linear."""
    name: str = "torch"
    """Label for logs."""
