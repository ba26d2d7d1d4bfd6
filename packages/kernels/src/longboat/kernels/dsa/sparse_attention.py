"""Sparse attention over selected keys (DeepSeek-V3.2 DSA), forward and backward in Triton.

One shared key/value head (MQA; MLA's absorbed form: queries taken into the latent space,
``k`` the latent plus the rotary key, ``v`` the latent, a view of ``k``'s first ``dv``
channels) and ``h`` query heads. A program owns one query token and ``BLOCK_H`` of its heads
(64 on Hopper at MLA's 128 heads: two programs a token): every head of a token attends the
same selected keys, so each gathered key row serves ``BLOCK_H`` heads and the products are
``[BLOCK_H, BLOCK_T]`` tile dots. The program walks the token's ``topk`` indices
``BLOCK_T`` at a time, gathers those rows of ``k`` by index and keeps an online softmax
(base-2: running max, sum, fp32 accumulator). The key's channels are two tiles: the first
``dv`` (the value's width when ``v`` is ``k``'s prefix, else the largest power of two within
``dk``) and the rest (MLA's 64 rotary channels), so 576 is not padded to 1024; when ``v`` is
a view of ``k``'s first ``dv`` channels the first tile *is* the value tile and the rows are
gathered once, not twice.

The output is a ``[b, sq, h, dv]`` view of a head-major ``[h, b, sq, dv]`` buffer: a per-head
projection after the attention (MLA's value up projection, a batched matmul over heads)
reads it as ``[h, b * sq, dv]`` without a copy, so the attention's output and that
projection's saved input are one tensor. The forward stores the log-sum-exp (base 2).

Backward, one pass over the same grid: recompute the probabilities from the log-sum-exp,
``ds = p * (dO . v - rowsum(dO * O))`` (the row sums in fp32 from the program's ``dO`` and
``O`` rows). ``dq`` of a (query, head block) belongs to its one program: it is accumulated
in fp32 registers over the program's key blocks and stored once, in q's dtype (no atomics,
no fp32 dq buffer). ``dk`` / ``dv`` rows are scattered (a key is chosen by many queries):
the program first reduces its ``BLOCK_H`` heads in a tile dot (``q^T ds`` and ``dO^T p``,
``[channels, BLOCK_T]``) and adds the result with one fp32 atomic per (query, head block,
key, channel); when ``v`` is ``k``'s prefix (and the gradient of ``v`` flows into ``k``, as
for a view) ``dv`` is added into ``dk``'s first ``dv`` channels, one buffer and one atomic
for both. On the GPU the last bits of ``dk`` / ``dv`` depend on the order the atomics land;
``dq`` and the forward are deterministic.

Why this shape (MLA at 32K tokens: h=128, dk=576, dv=512, topk=2048). Per step the
forward does 2 * s * h * topk * (dk + dv) = 18.7 TFLOP and the backward 2 * s * h * topk *
(3 dk + 2 dv) = 47 TFLOP. With 16 heads a program and a separate value gather, the gathers
were 1.2 TB a forward and the backward added ~5.8e11 fp32 atomics for dk / dv plus 1.5e11
for dq; with 64 heads and the value read from the key tile they are 155 GB and 7.7e10
(dq none). An atomic-free key-major pass (queries grouped by selected key through a sort)
would instead gather, per (key, selecting query), that query's 128 heads of q and dO
(~280 KB): ~19 TB against the atomics' ~0.3 TB, so the atomics stay. All heads of a token in
one program (128) would halve the atomics again but needs a ``[128, 576]`` fp32 dq in
registers (288 a thread at 8 warps), which does not fit. Tile sizes (``BLOCK_H``,
``BLOCK_T``, warps, pipeline stages) are a few ``triton.autotune`` candidates keyed on
``(h, dk, dv, topk)``, chosen from an sm_90 compile of each (shared memory, registers
spilled inside the loop): at 64 heads the backward's dq (144 registers a thread) beside
the ``[576, BLOCK_T]`` key-gradient tile spills, at 32 heads it does not but runs on mma
instead of wgmma tiles and gathers twice as often, so the tuner measures both; a
configuration over the shared memory is dropped by the tuner, the last resort (16 heads, 16
keys) fits any card. Under the interpreter one tiny configuration runs.

``chunk_rows`` launches the backward over chunks of query rows (one launch by default); each
program owns its dq rows, so chunking changes no result bit.

Indices must be distinct within a row; ``-1`` (or any index outside ``[0, sk)``) is no key.
Causality is the indexer's business: the kernel attends whatever is selected. A query with
no selected key outputs zeros.
"""

from __future__ import annotations

from typing import Any

import torch

from longboat.kernels._dispatch import op, resolve_impl, triton_interpreter_on
from longboat.kernels._triton import HAS_TRITON, next_pow2, tl, triton
from longboat.kernels.dsa.reference import sparse_attention_torch

Tensor = torch.Tensor

_LOG2E = 1.4426950408889634

# (BLOCK_H, BLOCK_T, num_warps, num_stages). Hopper at MLA's shape (bf16, compiled for
# sm_90: shared memory / spilled registers): the forward's 64 heads with 8 warps keep the
# [64, 512] fp32 accumulator at 128 registers a thread on wgmma tiles: 144 KB and next to
# no spilled registers in the loop at 32 keys a block (216 KB, a few at 64). The backward
# holds dq ([64, 576] fp32, 144 registers) beside a [512, BLOCK_T] dk tile: at 64 heads it
# spills inside the loop, at 32 heads much less but on the older mma instructions (M=32), so
# both stay candidates for the tuner to measure (64 x 32 with two stages needs 228 KB, over
# the 227 KB limit: one stage). _LAST_RESORT fits any card and is kept for <= 16 heads or fp32.
_FWD_TILES = [(64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (32, 64, 8, 2), (16, 32, 4, 2)]
_BWD_TILES = [(64, 16, 8, 2), (64, 32, 8, 1), (32, 16, 8, 2), (32, 32, 8, 2), (16, 32, 4, 2)]
_LAST_RESORT = (16, 16, 4, 1)
_INTERPRETER_TILE = (16, 16, 4, 1)
"""Under Triton's interpreter: small tiles (tests cover several head and key blocks)."""


def _configs(tiles: list[tuple[int, int, int, int]], key_grad: bool) -> list[Any]:
    """``triton.Config`` of each tile; ``key_grad`` (the backward): with ``DK_ROWS``, the
    orientation of the key-gradient tile (:func:`_heads_reduced`): rows below 64 heads
    (mma instructions either way; no spills at 32 heads x 16 keys), channels at 64 (wgmma
    wants 64 rows; as rows the tile does not fit shared memory). Under the interpreter the
    one tile comes in both orientations and :func:`_fitting_configs` picks by the parity
    of ``h``, so that the tests cover both."""
    interpreted = triton_interpreter_on()
    tiles = [_INTERPRETER_TILE] if interpreted else [*tiles, _LAST_RESORT]
    out = []
    for bh, bt, w, st in tiles:
        if not key_grad:
            out.append(triton.Config({"BLOCK_H": bh, "BLOCK_T": bt}, num_warps=w, num_stages=st))
            continue
        for rows in (True, False) if interpreted else (bh < 64,):
            meta = {"BLOCK_H": bh, "BLOCK_T": bt, "DK_ROWS": rows}
            out.append(triton.Config(meta, num_warps=w, num_stages=st))
    return out


def _fitting_configs(configs: list[Any], named_args: dict[str, Any], **kw: Any) -> list[Any]:
    """Drop head blocks wider than the heads need (padded heads are wasted work) and the last
    resort where wider tiles are left for bf16 at many heads; keep the narrowest when none
    is left. Under the interpreter: the key-gradient orientation by the parity of ``h``."""
    heads = int(named_args["H"])
    widest = max(16, next_pow2(heads))
    last = (_LAST_RESORT[0], _LAST_RESORT[1])
    keep_last = heads <= 16 or bool(kw.get("IEEE", named_args.get("IEEE", False)))
    fit = [
        c for c in configs
        if c.kwargs["BLOCK_H"] <= widest
        and (keep_last or (c.kwargs["BLOCK_H"], c.kwargs["BLOCK_T"]) != last)
    ]  # fmt: skip
    if triton_interpreter_on():
        fit = [c for c in fit if c.kwargs.get("DK_ROWS", heads % 2 == 0) == (heads % 2 == 0)]
    return fit or [min(configs, key=lambda c: c.kwargs["BLOCK_H"])]


def _tuned(
    tiles: list[tuple[int, int, int, int]], *, key_grad: bool = False,
    reset: list[str] | None = None,
) -> Any:  # fmt: skip
    """``triton.autotune`` over ``tiles`` keyed on the problem's widths (a no-op without
    Triton, where the kernels never run)."""
    if not HAS_TRITON:
        return lambda fn: fn
    return triton.autotune(
        configs=_configs(tiles, key_grad),
        key=["H", "DK", "DV", "TOPK", "V_IN_K", "IEEE"],
        prune_configs_by={"early_config_prune": _fitting_configs},
        reset_to_zero=reset,
    )


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` with fp32 accumulation; ``IEEE``: fp32 products (no TF32), and operands
    upcast to fp32 first (Triton's CPU interpreter mis-multiplies bf16 tiles; the operands
    are rounded to their dtype either way, so the result is the GPU's up to summation
    order)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _dot_acc(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` (fp32 ``acc``), products as :func:`_dot`."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _gather_rows(base, idx, valid, stride_s, col0, offs, ncols, FULL: tl.constexpr):
    """``base[idx, col0 + offs]`` as ``[BLOCK_T, len(offs)]``, 0 at invalid rows and at
    ``offs >= ncols`` (``FULL``: the tile is exactly ``ncols`` wide, no column mask: a
    loop-invariant ``[BLOCK_T, width]`` mask would hold registers through the loop)."""
    ptr = base + idx[:, None] * stride_s + col0 + offs[None, :]
    if FULL:
        return tl.load(ptr, mask=valid[:, None], other=0.0)
    return tl.load(ptr, mask=valid[:, None] & (offs < ncols)[None, :], other=0.0)


@triton.jit
def _selected(idx_row, t0, TOPK, SK, BLOCK_T: tl.constexpr):
    """The key block at ``t0``: (row indices with 0 at no-key slots, valid mask)."""
    offs_t = t0 + tl.arange(0, BLOCK_T)
    idx = tl.load(idx_row + offs_t, mask=offs_t < TOPK, other=-1).to(tl.int64)
    valid = (idx >= 0) & (idx < SK)
    return tl.where(valid, idx, 0), valid


@triton.jit
def _heads_reduced(w, x, IEEE: tl.constexpr, ROWS: tl.constexpr):
    """``sum_h w[h, t] * x[h, c]`` for weights ``w [BLOCK_H, BLOCK_T]`` (ds or p) and rows
    ``x [BLOCK_H, C]`` (q or dO): ``[BLOCK_T, C]`` when ``ROWS``, else ``[C, BLOCK_T]`` (the
    tensor-core tile then has ``C`` rows, as Hopper's wgmma wants at 64 heads)."""
    if ROWS:  # one return: the compiler wants one return type across static branches
        out = _dot(tl.trans(w), x, IEEE)
    else:
        out = _dot(tl.trans(x), w, IEEE)
    return out


@triton.jit
def _heads_reduced_acc(w, x, acc, IEEE: tl.constexpr, ROWS: tl.constexpr):
    """``acc +`` :func:`_heads_reduced` ``(w, x)``."""
    if ROWS:
        out = _dot_acc(tl.trans(w), x, acc, IEEE)
    else:
        out = _dot_acc(tl.trans(x), w, acc, IEEE)
    return out


@triton.jit
def _scatter_add(base, idx, valid, stride_s, col0, offs, ncols, tile, FULL: tl.constexpr,
                 ROWS: tl.constexpr):  # fmt: skip
    """fp32 atomic adds of ``tile`` (as :func:`_heads_reduced` lays it out) into rows ``idx``
    of ``base``, columns ``col0 + offs`` (``< ncols`` unless ``FULL``), valid rows only."""
    if ROWS:
        ptr = base + idx[:, None] * stride_s + col0 + offs[None, :]
        if FULL:
            ok = valid[:, None]
        else:
            ok = valid[:, None] & (offs < ncols)[None, :]
    else:
        ptr = base + idx[None, :] * stride_s + col0 + offs[:, None]
        if FULL:
            ok = valid[None, :]
        else:
            ok = (offs < ncols)[:, None] & valid[None, :]
    tl.atomic_add(ptr, tile, mask=ok, sem="relaxed")


@_tuned(_FWD_TILES)
@triton.jit
def _sparse_attn_fwd_kernel(
    Q, K, V, IDX, OUT, LSE,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_vb, stride_vs,
    stride_ib, stride_is, stride_ob, stride_os, stride_oh,
    SQ, H, SK, TOPK, DK, DV, KSPLIT, scale_log2,
    V_IN_K: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_KA: tl.constexpr,
    BLOCK_KB: tl.constexpr, BLOCK_DV: tl.constexpr, A_FULL: tl.constexpr,
    B_FULL: tl.constexpr, V_FULL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    # Key channels [0, KSPLIT) are tile a (the value's when V_IN_K), [KSPLIT, DK) tile b.
    row = tl.program_id(0).to(tl.int64)
    bi, qi = row // SQ, row % SQ
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_a = tl.arange(0, BLOCK_KA)
    offs_b = tl.arange(0, BLOCK_KB)
    offs_v = tl.arange(0, BLOCK_DV)
    q_rows = Q + bi * stride_qb + qi * stride_qs + offs_h[:, None] * stride_qh
    q_a = tl.load(q_rows + offs_a[None, :], mask=h_ok[:, None] & (offs_a < KSPLIT)[None, :],
                  other=0.0)  # fmt: skip
    if HAS_TAIL:
        q_b = tl.load(q_rows + KSPLIT + offs_b[None, :],
                      mask=h_ok[:, None] & (offs_b < DK - KSPLIT)[None, :], other=0.0)  # fmt: skip
    k_base, v_base = K + bi * stride_kb, V + bi * stride_vb
    idx_row = IDX + bi * stride_ib + qi * stride_is
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), dtype=tl.float32)
    for t0 in range(0, TOPK, BLOCK_T):
        idx, valid = _selected(idx_row, t0, TOPK, SK, BLOCK_T)
        k_a = _gather_rows(k_base, idx, valid, stride_ks, 0, offs_a, KSPLIT, A_FULL)
        s = _dot(q_a, tl.trans(k_a), IEEE)
        if HAS_TAIL:
            k_b = _gather_rows(k_base, idx, valid, stride_ks, KSPLIT, offs_b, DK - KSPLIT, B_FULL)
            s = _dot_acc(q_b, tl.trans(k_b), s, IEEE)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp finite
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if V_IN_K:
            v = k_a
        else:
            v = _gather_rows(v_base, idx, valid, stride_vs, 0, offs_v, DV, V_FULL)
        acc = _dot_acc(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m = m_new
    has_key = l_sum > 0.0
    out = acc / tl.where(has_key, l_sum, 1.0)[:, None]
    # +inf for a query without keys: its backward probabilities exp2(s - lse) are all 0.
    lse = tl.where(has_key, m + tl.log2(tl.where(has_key, l_sum, 1.0)), float("inf"))
    o_ptr = OUT + bi * stride_ob + qi * stride_os + offs_h[:, None] * stride_oh + offs_v[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=h_ok[:, None] & (offs_v < DV)[None, :])
    tl.store(LSE + row * H + offs_h, lse, mask=h_ok)


@_tuned(_BWD_TILES, key_grad=True, reset=["DK_", "DV_"])
@triton.jit
def _sparse_attn_bwd_kernel(
    Q, K, V, IDX, DO, OUT, LSE, DQ, DK_, DV_,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_vb, stride_vs,
    stride_ib, stride_is, stride_dob, stride_dos, stride_doh, stride_ob, stride_os, stride_oh,
    ROW0, SQ, H, SK, TOPK, DK, DV, KSPLIT, scale, scale_log2,
    V_IN_K: tl.constexpr, DV_INTO_DK: tl.constexpr, HAS_TAIL: tl.constexpr,
    BLOCK_KA: tl.constexpr, BLOCK_KB: tl.constexpr, BLOCK_DV: tl.constexpr,
    A_FULL: tl.constexpr, B_FULL: tl.constexpr, V_FULL: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, DK_ROWS: tl.constexpr,
):  # fmt: skip
    # Program 0 of this launch is query row ROW0 of the flattened [b * sq] rows. DQ
    # [b * sq, h, dk] contiguous in q's dtype; DK_ [b, sk, dk], DV_ [b, sk, dv] contiguous
    # fp32, zero-filled (DV_INTO_DK: dv goes into DK_'s first DV channels, DV_ unused).
    row = ROW0 + tl.program_id(0).to(tl.int64)
    bi, qi = row // SQ, row % SQ
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_a = tl.arange(0, BLOCK_KA)
    offs_b = tl.arange(0, BLOCK_KB)
    offs_v = tl.arange(0, BLOCK_DV)
    a_ok, b_ok, v_ok = offs_a < KSPLIT, offs_b < DK - KSPLIT, offs_v < DV
    hv_ok = h_ok[:, None] & v_ok[None, :]
    do = tl.load(DO + bi * stride_dob + qi * stride_dos + offs_h[:, None] * stride_doh
                 + offs_v[None, :], mask=hv_ok, other=0.0)  # fmt: skip
    o = tl.load(OUT + bi * stride_ob + qi * stride_os + offs_h[:, None] * stride_oh
                + offs_v[None, :], mask=hv_ok, other=0.0)  # fmt: skip
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)  # rowsum(dO * O), fp32
    lse = tl.load(LSE + row * H + offs_h, mask=h_ok, other=float("inf"))
    q_rows = Q + bi * stride_qb + qi * stride_qs + offs_h[:, None] * stride_qh
    q_a = tl.load(q_rows + offs_a[None, :], mask=h_ok[:, None] & a_ok[None, :], other=0.0)
    dq_a = tl.zeros((BLOCK_H, BLOCK_KA), dtype=tl.float32)
    if HAS_TAIL:
        q_b = tl.load(q_rows + KSPLIT + offs_b[None, :], mask=h_ok[:, None] & b_ok[None, :],
                      other=0.0)  # fmt: skip
        dq_b = tl.zeros((BLOCK_H, BLOCK_KB), dtype=tl.float32)
    k_base, v_base = K + bi * stride_kb, V + bi * stride_vb
    dk_base, dv_base = DK_ + bi * SK * DK, DV_ + bi * SK * DV
    idx_row = IDX + bi * stride_ib + qi * stride_is
    for t0 in range(0, TOPK, BLOCK_T):
        idx, valid = _selected(idx_row, t0, TOPK, SK, BLOCK_T)
        k_a = _gather_rows(k_base, idx, valid, stride_ks, 0, offs_a, KSPLIT, A_FULL)
        s = _dot(q_a, tl.trans(k_a), IEEE)
        if HAS_TAIL:
            k_b = _gather_rows(k_base, idx, valid, stride_ks, KSPLIT, offs_b, DK - KSPLIT, B_FULL)
            s = _dot_acc(q_b, tl.trans(k_b), s, IEEE)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        p = tl.exp2(s - lse[:, None])  # 0 at invalid keys, padded heads, keyless queries
        if V_IN_K:
            v = k_a
        else:
            v = _gather_rows(v_base, idx, valid, stride_vs, 0, offs_v, DV, V_FULL)
        dp = _dot(do, tl.trans(v), IEEE)  # [BLOCK_H, BLOCK_T]
        ds = p * (dp - delta[:, None]) * scale
        dq_a = _dot_acc(ds.to(k_a.dtype), k_a, dq_a, IEEE)
        # the block's heads reduced in a dot, then one atomic per (key, channel)
        ds_q = ds.to(q_a.dtype)
        p_c = p.to(do.dtype)
        dk_a = _heads_reduced(ds_q, q_a, IEEE, DK_ROWS)
        if DV_INTO_DK:  # KSPLIT == DV: tile a is the value's channels, one accumulator
            dk_a = _heads_reduced_acc(p_c, do, dk_a, IEEE, DK_ROWS)
            _scatter_add(dk_base, idx, valid, DK, 0, offs_a, KSPLIT, dk_a, A_FULL, DK_ROWS)
        else:
            _scatter_add(dk_base, idx, valid, DK, 0, offs_a, KSPLIT, dk_a, A_FULL, DK_ROWS)
            dv_t = _heads_reduced(p_c, do, IEEE, DK_ROWS)
            _scatter_add(dv_base, idx, valid, DV, 0, offs_v, DV, dv_t, V_FULL, DK_ROWS)
        if HAS_TAIL:
            dq_b = _dot_acc(ds.to(k_b.dtype), k_b, dq_b, IEEE)
            dk_b = _heads_reduced(ds_q, q_b, IEEE, DK_ROWS)
            _scatter_add(dk_base, idx, valid, DK, KSPLIT, offs_b, DK - KSPLIT, dk_b, B_FULL,
                         DK_ROWS)  # fmt: skip
    dq_rows = DQ + row * H * DK + offs_h[:, None] * DK
    tl.store(dq_rows + offs_a[None, :], dq_a.to(DQ.dtype.element_ty),
             mask=h_ok[:, None] & a_ok[None, :])  # fmt: skip
    if HAS_TAIL:
        tl.store(dq_rows + KSPLIT + offs_b[None, :], dq_b.to(DQ.dtype.element_ty),
                 mask=h_ok[:, None] & b_ok[None, :])  # fmt: skip


def _ieee_dots(q: Tensor) -> bool:
    """fp32 inputs get fp32 products (not TF32); under the interpreter every dtype does."""
    return q.dtype == torch.float32 or triton_interpreter_on()


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def value_in_key(k: Tensor, v: Tensor) -> bool:
    """True when ``v`` is ``k``'s first ``dv`` channels in memory (MLA's absorbed latent: a
    view of the key): the kernels then gather each key row once for both."""
    return (
        v.data_ptr() == k.data_ptr()
        and v.stride() == k.stride()
        and v.dtype == k.dtype
        and v.shape[:2] == k.shape[:2]
        and v.shape[-1] <= k.shape[-1]
    )


def _channel_split(dk: int, dv: int, v_in_k: bool) -> tuple[int, int]:
    """(key channels of tile a, its width): the value's ``dv`` when ``v`` is ``k``'s prefix,
    else the largest power of two within ``dk`` (all of a key narrower than 16)."""
    if v_in_k:
        split = dv
    else:
        split = dk if dk <= 16 else 1 << (dk.bit_length() - 1)
    return split, max(16, next_pow2(split))


def _launch_meta(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, dict[str, object]]:
    dk, dv = k.shape[-1], v.shape[-1]
    v_in_k = value_in_key(k, v)
    split, block_a = _channel_split(dk, dv, v_in_k)
    block_b, block_v = max(16, next_pow2(max(1, dk - split))), max(16, next_pow2(dv))
    return split, dict(
        V_IN_K=v_in_k, HAS_TAIL=dk > split, BLOCK_KA=block_a, BLOCK_KB=block_b,
        BLOCK_DV=block_v, A_FULL=block_a == split, B_FULL=block_b == dk - split,
        V_FULL=block_v == dv, IEEE=_ieee_dots(q),
    )  # fmt: skip


def _head_major(b: int, sq: int, h: int, dv: int, like: Tensor) -> Tensor:
    """An uninitialised ``[b, sq, h, dv]`` view of a contiguous ``[h, b, sq, dv]`` buffer."""
    return like.new_empty((h, b, sq, dv)).permute(1, 2, 0, 3)


def _sparse_attn_fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    b, sq, h, dk = q.shape
    sk, dv, topk = k.shape[1], v.shape[-1], indices.shape[-1]
    q, k, v, indices = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(indices)
    out = _head_major(b, sq, h, dv, q)
    lse = torch.empty((b, sq, h), device=q.device, dtype=torch.float32)
    if b * sq * h == 0:
        return out, lse
    split, meta = _launch_meta(q, k, v)
    grid = lambda m: (b * sq, triton.cdiv(h, m["BLOCK_H"]))  # noqa: E731
    _sparse_attn_fwd_kernel[grid](
        q, k, v, indices, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), indices.stride(0), indices.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        sq, h, sk, topk, dk, dv, split, scale * _LOG2E, **meta,
    )  # fmt: skip
    return out, lse


_sparse_attn_fwd = torch.library.custom_op("longboat::dsa_sparse_attention_fwd", mutates_args=())(
    _sparse_attn_fwd_impl
)


@_sparse_attn_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float):
    b, sq, h, _ = q.shape
    return _head_major(b, sq, h, v.shape[-1], q), q.new_empty((b, sq, h), dtype=torch.float32)


def _sparse_attn_bwd_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, indices: Tensor, out: Tensor, lse: Tensor,
    scale: float, chunk_rows: int, dv_into_dk: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    b, sq, h, dk = q.shape
    sk, dv, topk = k.shape[1], v.shape[-1], indices.shape[-1]
    q, k, v, indices = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(indices)
    dout, out, lse = _unit_last(dout), _unit_last(out), lse.contiguous()
    split, meta = _launch_meta(q, k, v)
    dv_into_dk = dv_into_dk and bool(meta["V_IN_K"])
    dq = torch.empty((b, sq, h, dk), device=q.device, dtype=q.dtype)
    dk_ = torch.zeros((b, sk, dk), device=q.device, dtype=torch.float32)
    dv_ = dk_ if dv_into_dk else torch.zeros((b, sk, dv), device=q.device, dtype=torch.float32)
    total = b * sq
    if total * h > 0:
        rows = min(total, chunk_rows or total)
        for r0 in range(0, total, rows):
            n = min(rows, total - r0)
            grid = lambda m, n=n: (n, triton.cdiv(h, m["BLOCK_H"]))  # noqa: E731
            _sparse_attn_bwd_kernel[grid](
                q, k, v, indices, dout, out, lse, dq, dk_, dv_,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), v.stride(0),
                v.stride(1), indices.stride(0), indices.stride(1),
                dout.stride(0), dout.stride(1), dout.stride(2),
                out.stride(0), out.stride(1), out.stride(2),
                r0, sq, h, sk, topk, dk, dv, split, scale, scale * _LOG2E,
                DV_INTO_DK=dv_into_dk, **meta,
            )  # fmt: skip
    else:
        dq.zero_()
    dk_out = dk_.to(k.dtype)
    # fused: v's gradient is inside dk (an empty placeholder keeps the op's signature)
    dv_out = v.new_empty((0,)) if dv_into_dk else dv_.to(v.dtype)
    return dq, dk_out, dv_out


_sparse_attn_bwd = torch.library.custom_op("longboat::dsa_sparse_attention_bwd", mutates_args=())(
    _sparse_attn_bwd_impl
)


@_sparse_attn_bwd.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, indices: Tensor, out: Tensor,
      lse: Tensor, scale: float, chunk_rows: int, dv_into_dk: bool):  # fmt: skip
    fused = dv_into_dk and value_in_key(k, v)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty((0,) if fused else v.shape)


def _views_of_one_tensor(k: Tensor, v: Tensor) -> bool:
    """True when autograd carries ``v``'s gradient into the tensor ``k`` is (a view of):
    ``v`` is a view of ``k`` or both are views of one base."""
    base = v._base
    return base is not None and (base is k or (k._base is not None and base is k._base))


class _SparseAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, chunk_rows):  # type: ignore[override]
        out, lse = op("dsa_sparse_attention_fwd", _sparse_attn_fwd_impl)(q, k, v, indices, scale)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale, ctx.chunk_rows = scale, chunk_rows
        # v's gradient may go into k's only when it would reach the same storage anyway
        ctx.dv_into_dk = k.requires_grad and v.requires_grad and _views_of_one_tensor(k, v)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, indices, out, lse = ctx.saved_tensors
        dq, dk, dv = op("dsa_sparse_attention_bwd", _sparse_attn_bwd_impl)(
            dout, q, k, v, indices, out, lse, ctx.scale, ctx.chunk_rows, ctx.dv_into_dk
        )
        fused = dv.numel() == 0 and v.numel() > 0
        return dq, dk, None if fused else dv, None, None, None


def sparse_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float,
    *, chunk_rows: int | None = None,
) -> Tensor:  # fmt: skip
    """Triton sparse attention (forward + backward), same signature as
    :func:`longboat.kernels.dsa.sparse_attention_torch`; the output is a view of a
    head-major buffer (module doc). ``chunk_rows``: query rows (of the flattened ``b * sq``)
    a backward launch takes (None: all in one launch; the results are the same)."""
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"sparse_attention: chunk_rows must be >= 1, got {chunk_rows}")
    return _SparseAttentionFn.apply(q, k, v, indices, float(scale), chunk_rows or 0)


def sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float, *, impl: str | None = None,
    chunk_rows: int | None = None,
) -> Tensor:  # fmt: skip
    """Attention of each query over its selected keys only (DSA's sparse attention).

    ``q [b, sq, h, dk]``; one key/value head shared by all query heads: ``k [b, sk, dk]``,
    ``v [b, sk, dv]`` (``dv`` may differ from ``dk``; ``v`` may be a view of ``k``, as
    MLA's absorbed latent is, and the kernels then read each key row once); ``indices
    [b, sq, topk]`` integer, distinct per row, ``-1`` for no key; ``scale`` multiplies
    ``q . k``. Returns ``[b, sq, h, dv]`` in q's dtype, softmax in fp32; gradients for
    ``q``, ``k``, ``v``. ``impl`` as every longboat kernel (Triton on CUDA under ``auto``;
    ``torch``: the dense masked reference). On Triton the output is a view of a head-major
    ``[h, b, sq, dv]`` buffer and ``chunk_rows`` sets the query rows of one backward launch
    (:func:`sparse_attention_triton`).
    """
    if q.dim() != 4 or k.dim() != 3 or v.dim() != 3 or indices.dim() != 3:
        raise ValueError(
            "sparse_attention: q must be [b, sq, h, dk], k [b, sk, dk], v [b, sk, dv], indices "
            f"[b, sq, topk]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, "
            f"{tuple(indices.shape)}"
        )
    b, sq = q.shape[:2]
    if k.shape[0] != b or k.shape[2] != q.shape[3] or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"sparse_attention: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if tuple(indices.shape[:2]) != (b, sq) or indices.is_floating_point():
        raise ValueError(
            f"sparse_attention: indices must be integer [{b}, {sq}, topk], got "
            f"{indices.dtype} {tuple(indices.shape)}"
        )
    if resolve_impl(impl, q, k, v) == "torch":
        return sparse_attention_torch(q, k, v, indices, scale)
    return sparse_attention_triton(q, k, v, indices, scale, chunk_rows=chunk_rows)


__all__ = ["sparse_attention", "sparse_attention_triton", "value_in_key"]
