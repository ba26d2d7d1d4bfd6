"""Split a fused QKV projection into q, k, v and rotate q and k, in one pass each way.

megatron's (and most GQA models') fused QKV linear writes each token's row grouped by KV
head: ``[groups, q_per_group + 2, head_dim]`` = the group's query heads, then its key head,
then its value head. Splitting that row with views, rotating q and k with RoPE and then
back-propagating costs a reshape copy of q, two rotation kernels each way and, in backward,
a concatenation of the three gradients over strided inputs (``torch.split``'s backward),
a full extra pass over the row per layer.

:func:`split_qkv_rope` reads the row once and writes rotated ``q [tokens, heads, d]``,
rotated ``k [tokens, groups, d]`` and ``v [tokens, groups, d]``; its backward reads the three
gradients once and writes the row gradient, rotated back, in the fused layout.

Layout and conventions: ``mixed`` is ``[*lead, groups * (q_per_group + 2) * head_dim]`` with
any leading dims (``[s, b]`` for megatron, ``[b, s]`` elsewhere) flattened to tokens; RoPE is
the NeoX / Llama half-split form over the first ``rotary_dim = 2 * cos.shape[-1]`` channels
(the rest pass through); ``positions`` gives each token's row of ``cos``/``sin``
(``[tokens]``, int) — for megatron's ``[s, b]`` layout that is ``arange(s)`` repeated
``b`` times per position, which :func:`positions_for_layout` builds.
"""

from __future__ import annotations

import torch

from longboat.kernels._dispatch import op, resolve_impl
from longboat.kernels._triton import next_pow2, tl, triton

Tensor = torch.Tensor


def positions_for_layout(seq: int, batch: int, *, seq_first: bool, device) -> Tensor:  # type: ignore[no-untyped-def]
    """Flat token positions for a ``[seq, batch]`` (seq_first) or ``[batch, seq]`` layout."""
    pos = torch.arange(seq, device=device, dtype=torch.int64)
    if seq_first:
        return pos.repeat_interleave(batch)
    return pos.repeat(batch)


def _check(mixed: Tensor, groups: int, q_per_group: int, cos: Tensor, sin: Tensor) -> int:
    width = mixed.shape[-1]
    slots = q_per_group + 2
    if groups <= 0 or q_per_group <= 0 or width % (groups * slots):
        raise ValueError(
            f"split_qkv_rope: last dim {width} is not groups={groups} x (q_per_group="
            f"{q_per_group} + 2) x head_dim"
        )
    head_dim = width // (groups * slots)
    if cos.shape != sin.shape or cos.dim() != 2 or 2 * cos.shape[-1] > head_dim:
        raise ValueError(
            f"split_qkv_rope: cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must be equal "
            f"[positions, rotary_dim // 2] with rotary_dim <= head_dim {head_dim}"
        )
    return head_dim


def split_qkv_rope_torch(
    mixed: Tensor, groups: int, q_per_group: int, cos: Tensor, sin: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Pure-torch reference: views + rotation in fp32, outputs in ``mixed``'s dtype."""
    d = _check(mixed, groups, q_per_group, cos, sin)
    lead = mixed.shape[:-1]
    x = mixed.reshape(-1, groups, q_per_group + 2, d)
    q = x[:, :, :q_per_group].reshape(x.shape[0], groups * q_per_group, d)
    k, v = x[:, :, q_per_group], x[:, :, q_per_group + 1]
    half = cos.shape[-1]
    c = cos[positions].float()[:, None, :]
    s = sin[positions].float()[:, None, :]

    def rot(t: Tensor) -> Tensor:
        t1, t2 = t[..., :half].float(), t[..., half : 2 * half].float()
        out = torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], dim=-1).to(t.dtype)
        return torch.cat([out, t[..., 2 * half :]], dim=-1)

    q, k = rot(q), rot(k)
    return (
        q.reshape(*lead, groups * q_per_group, d),
        k.reshape(*lead, groups, d),
        v.reshape(*lead, groups, d).clone(),
    )


@triton.jit
def _qkv_rope_kernel(
    ROW, Q, K, V, COS, SIN, POS, stride_cs,
    G: tl.constexpr, QPG: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BACKWARD: tl.constexpr,
):  # fmt: skip
    """One program per (token, group): the group's QPG + 2 head slots of one row."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pos = tl.load(POS + t).to(tl.int64)
    slot = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_HALF)
    dm = d < HALF
    c = tl.load(COS + pos * stride_cs + d, mask=dm, other=1.0).to(tl.float32)[None, :]
    sn = tl.load(SIN + pos * stride_cs + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    is_q = slot < QPG
    is_k = slot == QPG
    is_v = slot == QPG + 1
    rotates = (slot < QPG + 1)[:, None]
    row = ROW + t * (G * (QPG + 2) * D) + g * ((QPG + 2) * D) + slot[:, None] * D
    # q [tokens, G*QPG, D], k / v [tokens, G, D], all contiguous
    qp = Q + t * (G * QPG * D) + (g * QPG + slot[:, None]) * D
    kp = K + t * (G * D) + g * D + 0 * slot[:, None]
    vp = V + t * (G * D) + g * D + 0 * slot[:, None]
    m2 = (slot < QPG + 2)[:, None] & dm[None, :]
    mq, mk, mv = (
        is_q[:, None] & dm[None, :],
        is_k[:, None] & dm[None, :],
        is_v[:, None] & dm[None, :],
    )
    if BACKWARD:  # gather d(q), d(k), d(v) into slots, rotate back, write the row gradient
        sn = -sn
        x1 = (
            tl.load(qp + d[None, :], mask=mq, other=0.0).to(tl.float32)
            + tl.load(kp + d[None, :], mask=mk, other=0.0).to(tl.float32)
            + tl.load(vp + d[None, :], mask=mv, other=0.0).to(tl.float32)
        )
        x2 = (
            tl.load(qp + HALF + d[None, :], mask=mq, other=0.0).to(tl.float32)
            + tl.load(kp + HALF + d[None, :], mask=mk, other=0.0).to(tl.float32)
            + tl.load(vp + HALF + d[None, :], mask=mv, other=0.0).to(tl.float32)
        )
        y1 = tl.where(rotates, x1 * c - x2 * sn, x1)
        y2 = tl.where(rotates, x2 * c + x1 * sn, x2)
        tl.store(row + d[None, :], y1.to(ROW.dtype.element_ty), mask=m2)
        tl.store(row + HALF + d[None, :], y2.to(ROW.dtype.element_ty), mask=m2)
        if 2 * HALF < D:  # pass-through channels
            p = 2 * HALF + tl.arange(0, BLOCK_D)
            pm = p < D
            rest = (
                tl.load(qp + p[None, :], mask=is_q[:, None] & pm[None, :], other=0.0)
                + tl.load(kp + p[None, :], mask=is_k[:, None] & pm[None, :], other=0.0)
                + tl.load(vp + p[None, :], mask=is_v[:, None] & pm[None, :], other=0.0)
            )
            tl.store(row + p[None, :], rest, mask=(slot < QPG + 2)[:, None] & pm[None, :])
    else:  # read the row's slots, rotate q and k, scatter to q / k / v
        x1 = tl.load(row + d[None, :], mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(row + HALF + d[None, :], mask=m2, other=0.0).to(tl.float32)
        y1 = tl.where(rotates, x1 * c - x2 * sn, x1)
        y2 = tl.where(rotates, x2 * c + x1 * sn, x2)
        y1 = y1.to(Q.dtype.element_ty)
        y2 = y2.to(Q.dtype.element_ty)
        tl.store(qp + d[None, :], y1, mask=mq)
        tl.store(qp + HALF + d[None, :], y2, mask=mq)
        tl.store(kp + d[None, :], y1, mask=mk)
        tl.store(kp + HALF + d[None, :], y2, mask=mk)
        tl.store(vp + d[None, :], y1, mask=mv)
        tl.store(vp + HALF + d[None, :], y2, mask=mv)
        if 2 * HALF < D:
            p = 2 * HALF + tl.arange(0, BLOCK_D)
            pm = p < D
            rest = tl.load(
                row + p[None, :], mask=(slot < QPG + 2)[:, None] & pm[None, :], other=0.0
            )
            tl.store(qp + p[None, :], rest, mask=is_q[:, None] & pm[None, :])
            tl.store(kp + p[None, :], rest, mask=is_k[:, None] & pm[None, :])
            tl.store(vp + p[None, :], rest, mask=is_v[:, None] & pm[None, :])


def _launch(
    row: Tensor, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor,
    groups: int, q_per_group: int, backward: bool,
) -> None:  # fmt: skip
    tokens = row.shape[0]
    if tokens == 0:
        return
    d = q.shape[-1]
    half = cos.shape[-1]
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    block_s = next_pow2(q_per_group + 2)
    _qkv_rope_kernel[(tokens, groups)](
        row, q, k, v, cos, sin, pos, cos.stride(0),
        G=groups, QPG=q_per_group, D=d, HALF=half,
        BLOCK_S=block_s, BLOCK_HALF=next_pow2(half), BLOCK_D=next_pow2(max(d - 2 * half, 1)),
        BACKWARD=backward, num_warps=4 if block_s * next_pow2(half) <= 1024 else 8,
    )  # fmt: skip


def _qkv_rope_fwd_impl(
    mixed: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, groups: int, q_per_group: int
) -> tuple[Tensor, Tensor, Tensor]:
    row = mixed.reshape(-1, mixed.shape[-1]).contiguous()
    d = row.shape[-1] // (groups * (q_per_group + 2))
    n = row.shape[0]
    q = row.new_empty(n, groups * q_per_group, d)
    k = row.new_empty(n, groups, d)
    v = row.new_empty(n, groups, d)
    _launch(row, q, k, v, cos, sin, pos, groups, q_per_group, False)
    return q, k, v


def _qkv_rope_bwd_impl(
    dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor,
    groups: int, q_per_group: int,
) -> Tensor:  # fmt: skip
    dq, dk, dv = dq.contiguous(), dk.contiguous(), dv.contiguous()
    n, d = dq.shape[0], dq.shape[-1]
    row = dq.new_empty(n, groups * (q_per_group + 2) * d)
    _launch(row, dq, dk, dv, cos, sin, pos, groups, q_per_group, True)
    return row


_fwd_op = torch.library.custom_op("longboat::qkv_rope_fwd", mutates_args=())(_qkv_rope_fwd_impl)
_bwd_op = torch.library.custom_op("longboat::qkv_rope_bwd", mutates_args=())(_qkv_rope_bwd_impl)


@_fwd_op.register_fake
def _(mixed, cos, sin, pos, groups, q_per_group):  # type: ignore[no-untyped-def]
    n = mixed.numel() // mixed.shape[-1]
    d = mixed.shape[-1] // (groups * (q_per_group + 2))
    new = mixed.new_empty
    return new(n, groups * q_per_group, d), new(n, groups, d), new(n, groups, d)


@_bwd_op.register_fake
def _(dq, dk, dv, cos, sin, pos, groups, q_per_group):  # type: ignore[no-untyped-def]
    return dq.new_empty(dq.shape[0], groups * (q_per_group + 2) * dq.shape[-1])


class _QKVRopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed, cos, sin, pos, groups, q_per_group):  # type: ignore[override]
        ctx.save_for_backward(cos, sin, pos)
        ctx.meta = (groups, q_per_group, mixed.shape)
        return op("qkv_rope_fwd", _qkv_rope_fwd_impl)(mixed, cos, sin, pos, groups, q_per_group)

    @staticmethod
    def backward(ctx, dq, dk, dv):  # type: ignore[override]
        cos, sin, pos = ctx.saved_tensors
        groups, q_per_group, shape = ctx.meta
        drow = op("qkv_rope_bwd", _qkv_rope_bwd_impl)(
            dq, dk, dv, cos, sin, pos, groups, q_per_group
        )
        return drow.view(shape), None, None, None, None, None


def split_qkv_rope(
    mixed: Tensor,
    groups: int,
    q_per_group: int,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    *,
    impl: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused QKV row -> rotated ``q [*lead, heads, d]``, rotated ``k`` and ``v`` ``[*lead,
    groups, d]`` (see the module doc). ``positions``: ``[tokens]`` rows of ``cos``/``sin``."""
    d = _check(mixed, groups, q_per_group, cos, sin)
    lead = mixed.shape[:-1]
    tokens = mixed.numel() // mixed.shape[-1]
    if positions.shape != (tokens,):
        raise ValueError(
            f"split_qkv_rope: positions {tuple(positions.shape)} must be [tokens={tokens}]"
        )
    if resolve_impl(impl, mixed) == "torch":
        return split_qkv_rope_torch(mixed, groups, q_per_group, cos, sin, positions)
    q, k, v = _QKVRopeFn.apply(mixed, cos, sin, positions, groups, q_per_group)
    return (
        q.view(*lead, groups * q_per_group, d),
        k.view(*lead, groups, d),
        v.view(*lead, groups, d),
    )
