"""megatron's fused QKV-split + RoPE path, served by longboat's kernel instead of TE's.

megatron's self-attention has a switch, ``TransformerConfig.fused_single_qkv_rope``: instead
of splitting the fused QKV projection into q / k / v views and rotating q and k one at a time,
it hands the whole ``[s, b, groups, (q_per_group + 2) * head_dim]`` tensor to
``apply_fused_qkv_rotary_pos_emb``, which only Transformer Engine provides. Without TE the
switch is refused. :func:`install_fused_qkv_rope` gives megatron that function, backed by
``longboat.kernels.split_qkv_rope`` (one Triton pass each way on CUDA, torch elsewhere).

When it applies (megatron's own conditions): self-attention without q/k layer norms, no
packed sequences (THD), no inference context, RoPE on both q and k. Configs that hit any of
these must leave ``fused_single_qkv_rope`` off: megatron asserts otherwise. Interleaved
rotary and different q / k embeddings fall back to megatron's own rotation on the split views.
"""

from __future__ import annotations

from typing import Any

import torch

from longboat.kernels.qkv_rope import positions_for_layout, split_qkv_rope

_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_POS_CACHE: dict[tuple, torch.Tensor] = {}


def _cos_sin(freqs: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables ``[seq, rotary_dim // 2]`` from megatron's ``[s, 1, 1, rotary_dim]``
    frequencies (``cat(theta, theta)``), cached per frequency tensor."""
    key = (freqs.data_ptr(), tuple(freqs.shape), freqs.device, seq)
    hit = _CACHE.get(key)
    if hit is None:
        half = freqs.shape[-1] // 2
        theta = freqs[:seq, 0, 0, :half].float()
        if len(_CACHE) > 8:
            _CACHE.clear()
        hit = _CACHE[key] = (theta.cos(), theta.sin())
    return hit


def _positions(seq: int, batch: int, device: torch.device) -> torch.Tensor:
    key = (seq, batch, device)
    pos = _POS_CACHE.get(key)
    if pos is None:
        if len(_POS_CACHE) > 8:
            _POS_CACHE.clear()
        pos = _POS_CACHE[key] = positions_for_layout(seq, batch, seq_first=True, device=device)
    return pos


def _unfused(
    mixed_qkv: torch.Tensor, q_pos_emb: Any, k_pos_emb: Any, split_arg_list: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    query, key, value = torch.split(mixed_qkv, split_arg_list, dim=3)
    hn = split_arg_list[1]
    query = query.reshape(query.size(0), query.size(1), -1, hn)
    return (
        _apply_rotary_pos_emb_bshd(query, q_pos_emb),
        _apply_rotary_pos_emb_bshd(key, k_pos_emb),
        value,
    )


def fused_qkv_rope(
    mixed_qkv: torch.Tensor,
    q_pos_emb: torch.Tensor,
    k_pos_emb: torch.Tensor,
    qkv_split_arg_list: list[int],
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's ``apply_fused_qkv_rotary_pos_emb`` contract: ``mixed_qkv`` ``[s, b, groups,
    (q_per_group + 2) * hn]``, ``*_pos_emb`` ``[s, 1, 1, rotary_dim]`` -> query ``[s, b, heads,
    hn]``, key and value ``[s, b, groups, hn]``."""
    q_width, hn, v_width = qkv_split_arg_list
    same = q_pos_emb is k_pos_emb or (
        q_pos_emb.shape == k_pos_emb.shape and q_pos_emb.data_ptr() == k_pos_emb.data_ptr()
    )
    if args or kwargs or not same or v_width != hn or q_width % hn or q_pos_emb.dim() != 4:
        return _unfused(mixed_qkv, q_pos_emb, k_pos_emb, qkv_split_arg_list)
    s, b, groups = mixed_qkv.shape[:3]
    cos, sin = _cos_sin(q_pos_emb, s)
    flat = mixed_qkv.reshape(s, b, -1)
    q, k, v = split_qkv_rope(flat, groups, q_width // hn, cos, sin, _positions(s, b, flat.device))
    return q, k, v


def install_fused_qkv_rope() -> None:
    """Give megatron's attention module :func:`fused_qkv_rope` as its fused QKV RoPE
    (idempotent). Turn it on per model with ``TransformerConfig.fused_single_qkv_rope``."""
    from megatron.core.transformer import attention

    attention.apply_fused_qkv_rotary_pos_emb = fused_qkv_rope
    attention.HAVE_FUSED_QKV_ROPE = True


def fused_qkv_rope_applies(
    *, qk_layernorm: bool, packed_sequences: bool, rotary_interleaved: bool, position: str
) -> bool:
    """Whether a model config can turn ``fused_single_qkv_rope`` on (megatron asserts when
    it is on for a layer that cannot use it)."""
    return position == "rope" and not (qk_layernorm or packed_sequences or rotary_interleaved)
