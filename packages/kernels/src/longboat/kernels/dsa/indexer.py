"""DeepSeek-V3.2's lightning indexer: per-query key scores (Triton) and the top-k keys.

The kernel computes the causal score matrix in fp32 tile by tile: a program owns
``BLOCK_M`` queries x ``BLOCK_N`` keys of one sample and sums
``weights[i, h] * relu(q[i, h] . k[j])`` over the index heads, accumulating in fp32; tiles
wholly above the causal diagonal are written ``-inf`` without any dot product. The top-k
is ``torch.topk`` over those scores (a Triton top-k, a per-row radix select over 32K+ keys,
is not written).

:func:`indexer_topk` (what training runs) never holds the whole ``[b, sq, sk]`` matrix: it
walks the queries in chunks of rows, scores each chunk against the keys its last query can
see (the causal prefix) and writes the chunk's top-k into the ``[b, sq, topk]`` indices, so
only ``[b, chunk, prefix]`` fp32 scores (``CHUNK_ELEMENTS`` at most: 512 MiB) and the
chunk's top-k temporaries are alive at once, against 4 GiB a sample for all the scores at
32K tokens. :func:`lightning_indexer` returns the whole matrix too (for checks and
inspection). The top-k has no gradient (V3.2 trains the indexer through its own KL loss,
not through the choice).
"""

from __future__ import annotations

import torch

from longboat.kernels._dispatch import op, resolve_impl, triton_interpreter_on
from longboat.kernels._triton import next_pow2, tl, triton
from longboat.kernels.dsa.reference import (
    indexer_scores_torch,
    lightning_indexer_torch,
    select_topk,
)

Tensor = torch.Tensor

_BLOCK_M, _BLOCK_N = 64, 64
_NUM_WARPS = 4

CHUNK_ELEMENTS = 1 << 27
"""fp32 elements of the largest chunk of scores :func:`indexer_topk` holds (512 MiB)."""


@triton.jit
def _indexer_scores_kernel(
    Q, K, W, S,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_wb, stride_ws, stride_wh,
    stride_sb, stride_ss,
    SQ, SK, H, D,
    RELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    m0 = tl.program_id(0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    bi = tl.program_id(2).to(tl.int64)
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < SQ
    col_ok = cols < SK
    shift = SK - SQ  # query i sees key j iff j <= i + shift
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if n0 <= m0 + BLOCK_M - 1 + shift:  # some key of the tile is visible to some query
        k = tl.load(
            K + bi * stride_kb + cols[None, :] * stride_ks + offs_d[:, None],
            mask=col_ok[None, :] & (offs_d[:, None] < D),
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        for h in range(H):
            q = tl.load(
                Q + bi * stride_qb + rows[:, None] * stride_qs + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D),
                other=0.0,
            )  # [BLOCK_M, BLOCK_D]
            if IEEE:  # fp32 products; the interpreter mis-multiplies bf16 tiles
                logits = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
            else:
                logits = tl.dot(q, k)
            if RELU:
                logits = tl.maximum(logits, 0.0)
            w = tl.load(
                W + bi * stride_wb + rows * stride_ws + h * stride_wh, mask=row_ok, other=0.0
            )
            acc += logits * w.to(tl.float32)[:, None]
    visible = cols[None, :] <= rows[:, None] + shift
    acc = tl.where(visible, acc, float("-inf"))
    tl.store(
        S + bi * stride_sb + rows[:, None] * stride_ss + cols[None, :], acc,
        mask=row_ok[:, None] & col_ok[None, :],
    )  # fmt: skip


def _indexer_scores_impl(q: Tensor, k: Tensor, weights: Tensor, relu: bool) -> Tensor:
    b, sq, h, d = q.shape
    sk = k.shape[1]
    q, k, weights = _unit_last(q), _unit_last(k), weights
    scores = torch.empty((b, sq, sk), device=q.device, dtype=torch.float32)
    if b * sq * sk == 0:
        return scores
    grid = (triton.cdiv(sq, _BLOCK_M), triton.cdiv(sk, _BLOCK_N), b)
    _indexer_scores_kernel[grid](
        q, k, weights, scores,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        weights.stride(0), weights.stride(1), weights.stride(2),
        scores.stride(0), scores.stride(1),
        sq, sk, h, d,
        RELU=relu, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_D=max(16, next_pow2(d)),
        IEEE=q.dtype == torch.float32 or triton_interpreter_on(), num_warps=_NUM_WARPS,
    )  # fmt: skip
    return scores


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


_indexer_scores = torch.library.custom_op("longboat::dsa_indexer_scores", mutates_args=())(
    _indexer_scores_impl
)


@_indexer_scores.register_fake
def _(q: Tensor, k: Tensor, weights: Tensor, relu: bool):
    return q.new_empty((q.shape[0], q.shape[1], k.shape[1]), dtype=torch.float32)


def indexer_scores_triton(q: Tensor, k: Tensor, weights: Tensor, *, relu: bool = True) -> Tensor:
    """Triton lightning-indexer scores ``[b, sq, sk]`` fp32 (``-inf`` above the causal
    diagonal), same math as :func:`longboat.kernels.dsa.indexer_scores_torch`."""
    with torch.no_grad():
        return op("dsa_indexer_scores", _indexer_scores_impl)(q, k, weights, relu)


def _check_shapes(q: Tensor, k: Tensor, weights: Tensor, topk: int, name: str) -> None:
    if q.dim() != 4 or k.dim() != 3 or weights.dim() != 3:
        raise ValueError(
            f"{name}: q must be [b, sq, heads, d], k [b, sk, d], weights "
            f"[b, sq, heads]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(weights.shape)}"
        )
    b, sq, h, d = q.shape
    if k.shape[0] != b or k.shape[2] != d or tuple(weights.shape) != (b, sq, h):
        raise ValueError(
            f"{name}: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"weights {tuple(weights.shape)}"
        )
    if topk < 1:
        raise ValueError(f"{name}: topk must be >= 1, got {topk}")


def chunk_rows_for(row_elements: int, chunk_rows: int | None = None) -> int:
    """Rows of a chunk whose rows hold ``row_elements`` fp32 elements each: ``chunk_rows``
    when given, else as many as fit ``CHUNK_ELEMENTS`` (at least one)."""
    if chunk_rows is not None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        return chunk_rows
    return max(1, CHUNK_ELEMENTS // max(1, row_elements))


def indexer_topk(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    topk: int,
    *,
    relu: bool = True,
    impl: str | None = None,
    chunk_rows: int | None = None,
) -> Tensor:
    """DSA's key selection without the whole score matrix: ``indices [b, sq, topk]`` int64,
    the same keys as :func:`lightning_indexer`'s (module doc).

    Queries are scored ``chunk_rows`` at a time (None: as many as keep ``[b, rows, sk]``
    fp32 within ``CHUNK_ELEMENTS``), each chunk against the keys its last query sees only;
    arguments otherwise as :func:`lightning_indexer`. No gradient.
    """
    _check_shapes(q, k, weights, topk, "indexer_topk")
    b, sq = q.shape[:2]
    sk = k.shape[1]
    rows = chunk_rows_for(b * sk, chunk_rows)
    use_torch = resolve_impl(impl, q, k, weights) == "torch"
    indices = torch.full((b, sq, topk), -1, dtype=torch.int64, device=q.device)
    with torch.no_grad():
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            width = min(sk, r1 + sk - sq)  # keys the chunk's last query sees
            if width <= 0:
                continue  # every query of the chunk sees no key: its row stays -1
            args = (q[:, r0:r1], k[:, :width], weights[:, r0:r1])
            if use_torch:
                scores = indexer_scores_torch(*args, relu=relu)
            else:
                scores = op("dsa_indexer_scores", _indexer_scores_impl)(*args, relu)
            indices[:, r0:r1] = select_topk(scores, topk)
            del scores
    return indices


def lightning_indexer(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    topk: int,
    *,
    relu: bool = True,
    impl: str | None = None,
) -> tuple[Tensor, Tensor]:
    """DSA's key selection: ``(scores [b, sq, sk] fp32, indices [b, sq, topk] int64)``.

    ``q [b, sq, index_heads, d]``, ``k [b, sk, d]``, ``weights [b, sq, index_heads]`` (the
    per-head weights, already scaled as the model scales them); score of key ``j`` for query
    ``i``: ``sum_h weights[i, h] * relu(q[i, h] . k[j])`` (``relu=False`` drops the ReLU),
    causal (``j <= i + sk - sq``). ``indices`` holds the ``topk`` best visible keys of each
    query (in descending score), ``-1`` where fewer are visible. Neither output has a
    gradient. ``impl`` as every longboat kernel (Triton on CUDA under ``auto``); the top-k
    itself is ``torch.topk`` on both paths. The scores are ``4 * b * sq * sk`` bytes; where
    only the keys are wanted, :func:`indexer_topk` selects them in chunks of queries.
    """
    _check_shapes(q, k, weights, topk, "lightning_indexer")
    if resolve_impl(impl, q, k, weights) == "torch":
        with torch.no_grad():
            return lightning_indexer_torch(q, k, weights, topk, relu=relu)
    scores = indexer_scores_triton(q, k, weights, relu=relu)
    return scores, select_topk(scores, topk)


__all__ = [
    "CHUNK_ELEMENTS",
    "chunk_rows_for",
    "indexer_scores_triton",
    "indexer_topk",
    "lightning_indexer",
]
