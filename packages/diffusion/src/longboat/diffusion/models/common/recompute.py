"""Activation recompute of DiT blocks that keeps the self-attention's outputs.

A recomputed block keeps only its inputs and runs its forward again in the backward. On
video-length sequences most of that forward is the self-attention kernel (at Wan 1.3B and
32,760 tokens, 11 of the block's ~16 forward milliseconds), while its outputs are small: the
attention output (2 bytes x hidden per token) and fp32 softmax statistics (4 bytes x heads per
token). ``recompute_block`` therefore saves the outputs of the self-attention kernels and lets
everything else (projections, norms, modulation, feed-forward, cross-attention over the
caption) be recomputed, through torch's selective activation checkpointing: in the backward
the kernel's cached outputs stand in for a second call, and its gradient is computed from them
and the recomputed queries, keys and values.

Self-attention is recognised by its kernel (the aten / library ops of SDPA's flash, cuDNN,
memory-efficient and CPU kernels, flash varlen, flash-attn) with queries and keys of one
shape; attention to a caption (keys of another length) is recomputed. ``keep_attention=False``
recomputes everything (least memory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

ATTENTION_OPS = frozenset(
    {
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "_varlen_attn",
        "_flash_attn_forward",
        "_flash_attn_varlen_forward",
    }
)
"""Names (overload packets) of the attention kernels' forward ops."""


def is_self_attention(op: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``op(*args)`` is an attention kernel over queries and keys of one shape."""
    name = getattr(getattr(op, "overloadpacket", op), "__name__", "")
    if name not in ATTENTION_OPS or len(args) < 2:
        return False
    q, k = args[0], args[1]
    return isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.shape == k.shape


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if is_self_attention(op, args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _keep_attention_context() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def recompute_block(block: Callable[..., Any], *args: Any, keep_attention: bool = True) -> Any:
    """``block(*args)`` with its activations recomputed in the backward; with
    ``keep_attention`` the self-attention kernels' outputs are kept instead (see the module
    doc)."""
    if keep_attention:
        return checkpoint(block, *args, use_reentrant=False, context_fn=_keep_attention_context)
    return checkpoint(block, *args, use_reentrant=False)


__all__ = ["ATTENTION_OPS", "is_self_attention", "recompute_block"]
