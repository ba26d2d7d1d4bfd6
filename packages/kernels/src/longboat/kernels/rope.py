"""Rotary position embedding applied to q and k in one pass (NeoX / Llama half-split layout).

Layouts: ``q`` is ``[batch, seq, heads_q, head_dim]`` or packed ``[tokens, heads_q, head_dim]``;
``k`` the same with its own head count (GQA). ``cos``/``sin`` are tables
``[max_positions, rotary_dim // 2]`` (see :func:`rope_cos_sin`), gathered per token by
``position_ids`` (``[seq]``, ``[batch, seq]`` or ``[tokens]``), so packed sequences whose
positions restart per document work. With ``rotary_dim < head_dim`` (partial rotary) only the
first ``rotary_dim`` channels rotate; the rest pass through.
"""

from __future__ import annotations

import torch

from longboat.kernels._dispatch import op, resolve_impl
from longboat.kernels._triton import next_pow2, tl, triton

Tensor = torch.Tensor


def rope_cos_sin(
    max_positions: int,
    rotary_dim: int,
    base: float = 10000.0,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """``cos``/``sin`` tables ``[max_positions, rotary_dim // 2]`` for :func:`apply_rope`."""
    if rotary_dim % 2:
        raise ValueError(f"rope_cos_sin: rotary_dim={rotary_dim} must be even")
    inv_freq = 1.0 / (
        base ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float64) / rotary_dim)
    )
    freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float64), inv_freq)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def _positions(x: Tensor, position_ids: Tensor | None) -> Tensor:
    """Flat ``[batch * seq]`` int64 positions for a 4-D ``x``."""
    b, s = x.shape[0], x.shape[1]
    if position_ids is None:
        return torch.arange(s, device=x.device).repeat(b)
    return position_ids.to(device=x.device, dtype=torch.int64).expand(b, s).reshape(-1)


def apply_rope_torch(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Pure-torch reference of :func:`apply_rope` (rotation in fp32)."""
    packed = q.dim() == 3
    q4, k4 = (q.unsqueeze(0), k.unsqueeze(0)) if packed else (q, k)
    pos = _positions(q4, position_ids).view(q4.shape[0], q4.shape[1])
    c = cos[pos].float().unsqueeze(2)  # [b, s, 1, r/2]
    s_ = sin[pos].float().unsqueeze(2)
    half = cos.shape[-1]

    def rot(x: Tensor) -> Tensor:
        x1 = x[..., :half].float()
        x2 = x[..., half : 2 * half].float()
        out = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1).to(x.dtype)
        return torch.cat([out, x[..., 2 * half :]], dim=-1)

    qo, ko = rot(q4), rot(k4)
    return (qo.squeeze(0), ko.squeeze(0)) if packed else (qo, ko)


@triton.jit
def _rotate_heads(
    X, XO, in_base, out_base, stride_h, stride_ho, H, c, sn,
    HALF: tl.constexpr, PASS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    COPY_PASS: tl.constexpr,
):  # fmt: skip
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    m = (h < H)[:, None] & (d < HALF)[None, :]
    xp = X + in_base + h[:, None] * stride_h + d[None, :]
    op = XO + out_base + h[:, None] * stride_ho + d[None, :]
    x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(op, (x1 * c - x2 * sn).to(XO.dtype.element_ty), mask=m)
    tl.store(op + HALF, (x2 * c + x1 * sn).to(XO.dtype.element_ty), mask=m)
    if COPY_PASS:
        p = tl.arange(0, BLOCK_PASS)
        pm = (h < H)[:, None] & (p < PASS)[None, :]
        off = 2 * HALF + p[None, :]
        xpass = tl.load(X + in_base + h[:, None] * stride_h + off, mask=pm, other=0.0)
        tl.store(XO + out_base + h[:, None] * stride_ho + off, xpass, mask=pm)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, POS, seq,
    sqb, sqs, sqh, skb, sks, skh, sqob, sqos, sqoh, skob, skos, skoh, stride_cs,
    HQ, HK,
    HALF: tl.constexpr, PASS: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BACKWARD: tl.constexpr, COPY_PASS: tl.constexpr, HAS_POS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    b = t // seq
    s = t % seq
    if HAS_POS:
        pos = tl.load(POS + t).to(tl.int64)
    else:  # positions 0..seq-1 in every sequence
        pos = s
    d = tl.arange(0, BLOCK_HALF)
    dm = d < HALF
    c = tl.load(COS + pos * stride_cs + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    sn = tl.load(SIN + pos * stride_cs + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:  # the transpose of a rotation is the rotation by -angle
        sn = -sn
    _rotate_heads(
        Q, QO, b * sqb + s * sqs, b * sqob + s * sqos, sqh, sqoh, HQ, c, sn,
        HALF, PASS, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS, COPY_PASS,
    )  # fmt: skip
    _rotate_heads(
        K, KO, b * skb + s * sks, b * skob + s * skos, skh, skoh, HK, c, sn,
        HALF, PASS, BLOCK_HK, BLOCK_HALF, BLOCK_PASS, COPY_PASS,
    )  # fmt: skip


def _unit_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(
    q: Tensor, k: Tensor, qo: Tensor, ko: Tensor, cos: Tensor, sin: Tensor, pos: Tensor | None,
    backward: bool,
) -> None:  # fmt: skip
    b, s, hq, d = q.shape
    hk = k.shape[2]
    half = cos.shape[-1]
    pas = d - 2 * half
    cos, sin = _unit_last(cos), _unit_last(sin)
    if b * s == 0:
        return
    block = next_pow2(max(hq, hk)) * next_pow2(half)
    _rope_kernel[(b * s,)](
        q, k, qo, ko, cos, sin, pos if pos is not None else cos, s,
        *q.stride()[:3], *k.stride()[:3], *qo.stride()[:3], *ko.stride()[:3], cos.stride(0),
        hq, hk,
        HALF=half, PASS=pas,
        BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk),
        BLOCK_HALF=next_pow2(half), BLOCK_PASS=next_pow2(max(pas, 1)),
        BACKWARD=backward, COPY_PASS=pas > 0 and qo.data_ptr() != q.data_ptr(),
        HAS_POS=pos is not None,
        num_warps=4 if block <= 2048 else 8,
    )  # fmt: skip


def _rope_fwd_impl(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, pos: Tensor | None, backward: bool
) -> tuple[Tensor, Tensor]:
    q4, k4 = _unit_last(q), _unit_last(k)
    qo = torch.empty(q4.shape, device=q.device, dtype=q.dtype)
    ko = torch.empty(k4.shape, device=k.device, dtype=k.dtype)
    _launch(q4, k4, qo, ko, cos, sin, pos, backward)
    return qo, ko


_rope_fwd = torch.library.custom_op("longboat::rope_fwd", mutates_args=())(_rope_fwd_impl)


@_rope_fwd.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, pos: Tensor | None, backward: bool):
    return q.new_empty(q.shape), k.new_empty(k.shape)


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, pos):  # type: ignore[override]
        ctx.save_for_backward(cos, sin, pos)
        return op("rope_fwd", _rope_fwd_impl)(q, k, cos, sin, pos, False)

    @staticmethod
    def backward(ctx, dqo, dko):  # type: ignore[override]
        cos, sin, pos = ctx.saved_tensors
        dq, dk = op("rope_fwd", _rope_fwd_impl)(dqo, dko, cos, sin, pos, True)
        return dq, dk, None, None, None


def apply_rope_triton(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Triton RoPE (fwd + bwd), same signature as :func:`apply_rope_torch`."""
    packed = q.dim() == 3
    q4, k4 = (q.unsqueeze(0), k.unsqueeze(0)) if packed else (q, k)
    pos = None if position_ids is None else _positions(q4, position_ids)
    qo, ko = _RopeFn.apply(q4, k4, cos, sin, pos)
    return (qo.squeeze(0), ko.squeeze(0)) if packed else (qo, ko)


def apply_rope_(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """In-place Triton RoPE for inference (no autograd): rotates ``q`` and ``k`` in memory."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise ValueError("apply_rope_: in-place RoPE has no backward; use apply_rope for training")
    packed = q.dim() == 3
    q4, k4 = (q.unsqueeze(0), k.unsqueeze(0)) if packed else (q, k)
    if q4.stride(-1) != 1 or k4.stride(-1) != 1:
        raise ValueError("apply_rope_: q and k need a contiguous head_dim for in-place rotation")
    pos = None if position_ids is None else _positions(q4, position_ids)
    _launch(q4, k4, q4, k4, cos, sin, pos, False)
    return q, k


def apply_rope(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    position_ids: Tensor | None = None,
    *,
    impl: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Rotate ``q`` and ``k`` by their tokens' positions; returns new ``(q, k)``."""
    if q.dim() not in (3, 4) or k.dim() != q.dim() or q.shape[:-2] != k.shape[:-2]:
        raise ValueError(
            f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must both be "
            "[batch, seq, heads, head_dim] or [tokens, heads, head_dim]"
        )
    if q.shape[-1] != k.shape[-1] or cos.shape != sin.shape or cos.dim() != 2:
        raise ValueError(
            f"apply_rope: head_dims {q.shape[-1]}/{k.shape[-1]} must match and cos/sin "
            f"{tuple(cos.shape)}/{tuple(sin.shape)} must be equal [max_positions, rotary_dim//2]"
        )
    if 2 * cos.shape[-1] > q.shape[-1]:
        raise ValueError(
            f"apply_rope: rotary_dim {2 * cos.shape[-1]} exceeds head_dim {q.shape[-1]}"
        )
    # Inductor ties (benchmarks/notes/kernels.md) and can fuse the rotation into neighbours.
    if resolve_impl(impl, q, compiled_reference_wins=True) == "torch":
        return apply_rope_torch(q, k, cos, sin, position_ids)
    return apply_rope_triton(q, k, cos, sin, position_ids)
