"""Attention masks: packed documents (from ``cu_seqlens``), prefix-LM and block-causal.

Dense masks are bool, ``True`` = may attend, broadcastable to ``[batch, heads, q, kv]``.
The ``*_block_mask`` variants build FlexAttention ``BlockMask`` objects for the same
patterns, which skip fully masked tiles instead of materialising ``[q, kv]``.
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor


def document_ids(cu_seqlens: Tensor, total: int | None = None) -> Tensor:
    """Per-token document index ``[total]`` from ``cu_seqlens`` (``[docs + 1]``, starts at 0)."""
    cu = cu_seqlens.to(torch.int64)
    total = int(cu[-1]) if total is None else total
    pos = torch.arange(total, device=cu.device)
    return torch.searchsorted(cu[1:], pos, right=True)


def document_mask(cu_seqlens: Tensor, *, causal: bool = False, total: int | None = None) -> Tensor:
    """Dense ``[1, 1, T, T]`` mask: tokens attend only within their own packed document."""
    doc = document_ids(cu_seqlens, total)
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask = mask & torch.ones_like(mask).tril()
    return mask[None, None]


def prefix_lm_mask(prefix_lens: Tensor, seq_len: int, *, valid: Tensor | None = None) -> Tensor:
    """Dense ``[batch, 1, S, S]`` prefix-LM mask (pi0.5-style VLA prefix).

    Prefix tokens (``pos < prefix_lens[b]``: images + prompt) attend bidirectionally among
    themselves; later tokens attend to the whole prefix and causally to each other.
    ``valid`` (``[batch, S]`` bool) additionally hides padding keys.
    """
    pos = torch.arange(seq_len, device=prefix_lens.device)
    q, kv = pos[:, None], pos[None, :]
    mask = (kv[None] < prefix_lens.view(-1, 1, 1)) | (kv <= q)[None]
    if valid is not None:
        mask = mask & valid[:, None, :]
    return mask[:, None]


def block_causal_mask(block_ids: Tensor, *, valid: Tensor | None = None) -> Tensor:
    """Dense ``[batch, 1, S, S]`` mask from per-token block ids (pi0's ``att_masks`` cumsum).

    A token attends to every token whose block id is <= its own: blocks are bidirectional
    inside and causal between each other (prefix block 0, state block 1, action block 2...).
    """
    mask = block_ids[:, None, :] <= block_ids[:, :, None]
    if valid is not None:
        mask = mask & valid[:, None, :]
    return mask[:, None]


def _create_block_mask(mask_mod: Any, b: int | None, q_len: int, kv_len: int, device: Any) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, b, None, q_len, kv_len, device=str(device))


def document_block_mask(cu_seqlens: Tensor, *, causal: bool, total: int | None = None) -> Any:
    """FlexAttention ``BlockMask`` for packed documents (batch 1, ``T`` tokens)."""
    doc = document_ids(cu_seqlens, total)
    t = doc.numel()

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        same = doc[q] == doc[kv]
        return same & (q >= kv) if causal else same

    return _create_block_mask(mask_mod, None, t, t, doc.device)


def prefix_lm_block_mask(prefix_lens: Tensor, seq_len: int) -> Any:
    """FlexAttention ``BlockMask`` for :func:`prefix_lm_mask` (without padding)."""
    prefix = prefix_lens.to(torch.int64)

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (kv < prefix[b]) | (kv <= q)

    return _create_block_mask(mask_mod, prefix.numel(), seq_len, seq_len, prefix.device)


def block_mask_from_dense(mask: Tensor) -> Any:
    """FlexAttention ``BlockMask`` reproducing a dense bool mask ``[B|1, H|1, Q, KV]``."""
    m4 = mask if mask.dim() == 4 else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    bsz, heads, q_len, kv_len = m4.shape

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        bi = b if bsz > 1 else torch.zeros_like(b)
        hi = h if heads > 1 else torch.zeros_like(h)
        return m4[bi, hi, q, kv]

    if heads > 1:
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(mask_mod, bsz, heads, q_len, kv_len, device=str(mask.device))
    return _create_block_mask(mask_mod, bsz if bsz > 1 else None, q_len, kv_len, mask.device)
