"""Dense masked torch references of DeepSeek-V3.2 sparse attention (DSA).

Shapes (batch first; ``h`` query heads, one shared key/value head as in MLA's absorbed form):

- indexer: ``q [b, sq, index_heads, d]``, ``k [b, sk, d]``, ``weights [b, sq, index_heads]``;
  the score of key ``j`` for query ``i`` is ``sum_h weights[i, h] * relu(q[i, h] . k[j])``.
- attention: ``q [b, sq, h, dk]``, ``k [b, sk, dk]``, ``v [b, sk, dv]`` (``dv`` may differ
  from ``dk``; in MLA's absorbed form ``v`` is the first ``kv_lora_rank`` channels of ``k``),
  ``indices [b, sq, topk]`` (integer key positions, ``-1`` = no key).

Causality: query ``i`` sees key ``j`` iff ``j <= i + sk - sq`` (the last query sees every
key; with ``sq == sk`` the usual causal mask).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def causal_key_mask(sq: int, sk: int, device: torch.device) -> Tensor:
    """``[sq, sk]`` bool: True where query ``i`` may see key ``j`` (``j <= i + sk - sq``)."""
    rows = torch.arange(sq, device=device)[:, None] + (sk - sq)
    return torch.arange(sk, device=device)[None, :] <= rows


def indexer_scores_torch(q: Tensor, k: Tensor, weights: Tensor, *, relu: bool = True) -> Tensor:
    """Lightning-indexer scores ``[b, sq, sk]`` in fp32, ``-inf`` above the causal diagonal."""
    logits = torch.einsum("bshd,btd->bsht", q.float(), k.float())
    if relu:
        logits = torch.relu(logits)
    scores = (logits * weights.float().unsqueeze(-1)).sum(dim=2)
    visible = causal_key_mask(q.shape[1], k.shape[1], q.device)
    return scores.masked_fill(~visible, float("-inf"))


def select_topk(scores: Tensor, topk: int) -> Tensor:
    """The ``topk`` best keys of each query, ``[b, sq, topk]`` int64; a slot whose best
    remaining score is ``-inf`` (fewer visible keys than ``topk``) holds ``-1``. Always
    ``topk`` columns: with fewer keys than ``topk`` the tail is ``-1``."""
    keep = min(topk, scores.shape[-1])
    best, idx = scores.topk(keep, dim=-1)
    idx = idx.masked_fill(best == float("-inf"), -1)
    if keep < topk:
        idx = torch.nn.functional.pad(idx, (0, topk - keep), value=-1)
    return idx


def lightning_indexer_torch(
    q: Tensor, k: Tensor, weights: Tensor, topk: int, *, relu: bool = True
) -> tuple[Tensor, Tensor]:
    """Reference of :func:`longboat.kernels.dsa.lightning_indexer`: ``(scores, indices)``."""
    scores = indexer_scores_torch(q, k, weights, relu=relu)
    return scores, select_topk(scores, topk)


def selected_key_mask(indices: Tensor, sk: int) -> Tensor:
    """``[b, sq, sk]`` bool: True at every key ``indices`` selects (``-1`` selects none)."""
    b, sq, _ = indices.shape
    mask = torch.zeros(b, sq, sk + 1, dtype=torch.bool, device=indices.device)
    slot = torch.where(indices < 0, sk, indices).long()  # -1 goes to a spare column
    mask.scatter_(-1, slot, True)
    return mask[..., :sk]


def sparse_attention_torch(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float
) -> Tensor:
    """Dense masked reference of :func:`longboat.kernels.dsa.sparse_attention`.

    The whole ``[b, h, sq, sk]`` score matrix in fp32, masked to the selected keys, softmax,
    times ``v``; a query with no selected key gets zeros. Output ``[b, sq, h, dv]`` in q's
    dtype."""
    scores = torch.einsum("bshd,btd->bhst", q.float(), k.float()) * scale
    keep = selected_key_mask(indices, k.shape[1]).unsqueeze(1)
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty row is all -inf: NaN -> 0
    out = torch.einsum("bhst,btd->bshd", probs, v.float())
    return out.to(q.dtype)


__all__ = [
    "causal_key_mask",
    "indexer_scores_torch",
    "lightning_indexer_torch",
    "select_topk",
    "selected_key_mask",
    "sparse_attention_torch",
]
