"""The DSA sparse-attention kernels as they were before the 64-head rewrite (commit afab894 of
``longboat.kernels.dsa.sparse_attention``), kept here only so that ``dsa_kernels.py`` can
time them beside the package's kernels on the same inputs; the package does not use them.

A program owns one query and 16 heads (8 programs a query at 128 heads, each gathering the
query's selected key rows in 64-wide chunks and the value rows separately); the backward adds
dk, dv and dq with fp32 atomics per key block and launches over chunks of query rows whose
fp32 dq fits ``CHUNK_ELEMENTS``. Plain autograd function (no custom op: the package registers
the op names).
"""

from __future__ import annotations

import torch

from longboat.kernels._dispatch import triton_interpreter_on
from longboat.kernels._triton import next_pow2, tl, triton
from longboat.kernels.dsa.indexer import chunk_rows_for

Tensor = torch.Tensor

_BLOCK_H, _BLOCK_T, _BLOCK_DK = 16, 32, 64
_NUM_WARPS = 4


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
def _scores(q_row, K, k_base, idx, valid, offs_h, h_ok, stride_qh, stride_ks, DK, scale,
            BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DK: tl.constexpr,
            IEEE: tl.constexpr):  # fmt: skip
    """``scale * q[heads] . k[idx]`` as ``[BLOCK_H, BLOCK_T]`` fp32, ``-inf`` at invalid."""
    s = tl.zeros((BLOCK_H, BLOCK_T), dtype=tl.float32)
    for d0 in range(0, DK, BLOCK_DK):
        offs_d = d0 + tl.arange(0, BLOCK_DK)
        d_ok = offs_d < DK
        q = tl.load(q_row + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        k = tl.load(k_base + idx[None, :] * stride_ks + offs_d[:, None],
                    mask=d_ok[:, None] & valid[None, :], other=0.0)  # fmt: skip
        s += _dot(q, k, IEEE)
    return tl.where(valid[None, :], s * scale, float("-inf"))


@triton.jit
def _sparse_attn_fwd_kernel(
    Q, K, V, IDX, OUT, LSE,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_vb, stride_vs,
    stride_ib, stride_is, stride_ob, stride_os, stride_oh,
    SQ, H, SK, TOPK, DK, DV, scale,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    bi, qi = row // SQ, row % SQ
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    q_row = Q + bi * stride_qb + qi * stride_qs
    k_base, v_base = K + bi * stride_kb, V + bi * stride_vb
    idx_row = IDX + bi * stride_ib + qi * stride_is
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), dtype=tl.float32)
    for t0 in range(0, TOPK, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        idx = tl.load(idx_row + offs_t, mask=offs_t < TOPK, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < SK)
        idx = tl.where(valid, idx, 0)
        s = _scores(q_row, K, k_base, idx, valid, offs_h, h_ok, stride_qh, stride_ks, DK,
                    scale, BLOCK_H, BLOCK_T, BLOCK_DK, IEEE)  # fmt: skip
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp finite
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + idx[:, None] * stride_vs + offs_dv[None, :],
                    mask=valid[:, None] & dv_ok[None, :], other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m = m_new
    has_key = l_sum > 0.0
    out = acc / tl.where(has_key, l_sum, 1.0)[:, None]
    # +inf for a query without keys: its backward probabilities exp(s - lse) are all 0.
    lse = tl.where(has_key, m + tl.log(tl.where(has_key, l_sum, 1.0)), float("inf"))
    o_ptr = OUT + bi * stride_ob + qi * stride_os + offs_h[:, None] * stride_oh + offs_dv[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + row * H + offs_h, lse, mask=h_ok)


@triton.jit
def _sparse_attn_bwd_kernel(
    Q, K, V, IDX, DO, OUT, LSE, DQ, DK_, DV_,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_vb, stride_vs,
    stride_ib, stride_is, stride_dob, stride_dos, stride_doh, stride_ob, stride_os, stride_oh,
    ROW0, SQ, H, SK, TOPK, DK, DV, scale,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Program 0 of this launch is query row ROW0 of the flattened [b * sq] rows.
    # DQ [rows of this launch, h, dk], DK_ [b, sk, dk], DV_ [b, sk, dv]: contiguous fp32,
    # zero-filled.
    local = tl.program_id(0).to(tl.int64)
    row = ROW0 + local
    bi, qi = row // SQ, row % SQ
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    q_row = Q + bi * stride_qb + qi * stride_qs
    k_base, v_base = K + bi * stride_kb, V + bi * stride_vb
    idx_row = IDX + bi * stride_ib + qi * stride_is
    hv_ok = h_ok[:, None] & dv_ok[None, :]
    do = tl.load(DO + bi * stride_dob + qi * stride_dos + offs_h[:, None] * stride_doh
                 + offs_dv[None, :], mask=hv_ok, other=0.0)  # fmt: skip
    o = tl.load(OUT + bi * stride_ob + qi * stride_os + offs_h[:, None] * stride_oh
                + offs_dv[None, :], mask=hv_ok, other=0.0)  # fmt: skip
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)  # rowsum(dO * O), fp32
    lse = tl.load(LSE + row * H + offs_h, mask=h_ok, other=float("inf"))
    dq_row = DQ + local * H * DK
    dk_base, dv_base = DK_ + bi * SK * DK, DV_ + bi * SK * DV
    for t0 in range(0, TOPK, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        idx = tl.load(idx_row + offs_t, mask=offs_t < TOPK, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < SK)
        idx = tl.where(valid, idx, 0)
        s = _scores(q_row, K, k_base, idx, valid, offs_h, h_ok, stride_qh, stride_ks, DK,
                    scale, BLOCK_H, BLOCK_T, BLOCK_DK, IEEE)  # fmt: skip
        p = tl.exp(s - lse[:, None])  # 0 at invalid keys and padded heads
        v = tl.load(v_base + idx[:, None] * stride_vs + offs_dv[None, :],
                    mask=valid[:, None] & dv_ok[None, :], other=0.0)  # fmt: skip
        dv = _dot(tl.trans(p.to(do.dtype)), do, IEEE)  # [BLOCK_T, BLOCK_DV]
        tl.atomic_add(dv_base + idx[:, None] * DV + offs_dv[None, :], dv,
                      mask=valid[:, None] & dv_ok[None, :])  # fmt: skip
        dp = _dot(do, tl.trans(v), IEEE)  # [BLOCK_H, BLOCK_T]
        ds = p * (dp - delta[:, None]) * scale
        for d0 in range(0, DK, BLOCK_DK):
            offs_d = d0 + tl.arange(0, BLOCK_DK)
            d_ok = offs_d < DK
            k = tl.load(k_base + idx[:, None] * stride_ks + offs_d[None, :],
                        mask=valid[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
            q = tl.load(q_row + offs_h[:, None] * stride_qh + offs_d[None, :],
                        mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
            dq = _dot(ds.to(k.dtype), k, IEEE)  # [BLOCK_H, BLOCK_DK]
            tl.atomic_add(dq_row + offs_h[:, None] * DK + offs_d[None, :], dq,
                          mask=h_ok[:, None] & d_ok[None, :])  # fmt: skip
            dk = _dot(tl.trans(ds.to(q.dtype)), q, IEEE)  # [BLOCK_T, BLOCK_DK]
            tl.atomic_add(dk_base + idx[:, None] * DK + offs_d[None, :], dk,
                          mask=valid[:, None] & d_ok[None, :])  # fmt: skip


def _ieee_dots(q: Tensor) -> bool:
    """fp32 inputs get fp32 products (not TF32); under the interpreter every dtype does."""
    return q.dtype == torch.float32 or triton_interpreter_on()


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_meta(q: Tensor, v: Tensor) -> dict[str, object]:
    return dict(
        BLOCK_H=_BLOCK_H, BLOCK_T=_BLOCK_T, BLOCK_DK=_BLOCK_DK,
        BLOCK_DV=max(16, next_pow2(v.shape[-1])), IEEE=_ieee_dots(q),
        num_warps=_NUM_WARPS,
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
    grid = (b * sq, triton.cdiv(h, _BLOCK_H))
    _sparse_attn_fwd_kernel[grid](
        q, k, v, indices, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), indices.stride(0), indices.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        sq, h, sk, topk, dk, dv, scale, **_launch_meta(q, v),
    )  # fmt: skip
    return out, lse


def _sparse_attn_bwd_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, indices: Tensor, out: Tensor, lse: Tensor,
    scale: float, chunk_rows: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    b, sq, h, dk = q.shape
    sk, dv, topk = k.shape[1], v.shape[-1], indices.shape[-1]
    q, k, v, indices = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(indices)
    dout, out, lse = _unit_last(dout), _unit_last(out), lse.contiguous()
    dq = torch.empty((b, sq, h, dk), device=q.device, dtype=q.dtype)
    dk_ = torch.zeros((b, sk, dk), device=q.device, dtype=torch.float32)
    dv_ = torch.zeros((b, sk, dv), device=q.device, dtype=torch.float32)
    total = b * sq
    if total * h == 0:
        return dq.zero_(), dk_.to(k.dtype), dv_.to(v.dtype)
    rows = min(total, chunk_rows_for(h * dk, chunk_rows or None))
    flat_dq = dq.view(total, h, dk)
    direct = q.dtype == torch.float32  # accumulate in the gradient itself
    buf = None if direct else torch.empty((rows, h, dk), device=q.device, dtype=torch.float32)
    meta = _launch_meta(q, v)
    for r0 in range(0, total, rows):
        n = min(rows, total - r0)
        acc = flat_dq[r0 : r0 + n] if direct else buf[:n]
        acc.zero_()
        _sparse_attn_bwd_kernel[(n, triton.cdiv(h, _BLOCK_H))](
            q, k, v, indices, dout, out, lse, acc, dk_, dv_,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), indices.stride(0), indices.stride(1),
            dout.stride(0), dout.stride(1), dout.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            r0, sq, h, sk, topk, dk, dv, scale, **meta,
        )  # fmt: skip
        if not direct:
            flat_dq[r0 : r0 + n].copy_(acc)
    return dq, dk_.to(k.dtype), dv_.to(v.dtype)


class _BeforeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale):  # type: ignore[override]
        out, lse = _sparse_attn_fwd_impl(q, k, v, indices, scale)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, indices, out, lse = ctx.saved_tensors
        dq, dk, dv = _sparse_attn_bwd_impl(dout, q, k, v, indices, out, lse, ctx.scale, 0)
        return dq, dk, dv, None, None


def sparse_attention_before(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float
) -> Tensor:
    """The previous Triton sparse attention (forward + backward), the package's signature."""
    return _BeforeFn.apply(q, k, v, indices, float(scale))


__all__ = ["sparse_attention_before"]
