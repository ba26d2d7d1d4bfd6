"""Fused linear + cross-entropy: ``hidden @ weight.T`` -> loss without full logits.

Tokens are processed in chunks: each chunk's logits ``[chunk, vocab]`` are computed, a
Triton kernel turns them in place into the loss and ``dloss/dlogits`` (softmax minus one-hot,
plus the z-loss term), and the chunk's contributions to ``dhidden`` and ``dweight`` are
accumulated right away. The forward therefore also computes the gradients (the loss is a
scalar, so backward only scales them); peak extra memory is one logits chunk.

Loss per token: ``lse - logit[target] + z_loss * lse**2``; ``ignore_index`` targets count
for nothing. ``reduction="mean"`` divides by the number of non-ignored tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longboat.kernels._dispatch import op, resolve_impl
from longboat.kernels._triton import next_pow2, tl, triton

Tensor = torch.Tensor
_CHUNK_BYTES = 1024 * 2**20  # one logits chunk: big enough that the chunk GEMMs run near peak
MAX_BLOCK_V = 16384  # vocab columns per kernel step (tests lower it to cross block edges)


def fused_linear_cross_entropy_torch(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> Tensor:
    """Unfused reference: full logits in fp32, ``F.cross_entropy`` plus optional z-loss."""
    del chunk_size  # the reference materialises all logits
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).float()
    t = target.reshape(-1)
    loss = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="none")
    valid = t != ignore_index
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).pow(2) * valid
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)


@triton.jit
def _ce_grad_kernel(
    LOGITS, stride_l, TARGET, LOSS, SCALE, V, ignore_index, z_coef,
    HAS_Z: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_l
    tgt = tl.load(TARGET + row).to(tl.int64)
    if tgt == ignore_index:
        for off in range(0, V, BLOCK_V):
            cols = off + tl.arange(0, BLOCK_V)
            tl.store(ptr + cols, tl.zeros([BLOCK_V], dtype=tl.float32).to(LOGITS.dtype.element_ty),
                     mask=cols < V)  # fmt: skip
        tl.store(LOSS + row, 0.0)
        return
    # Pass 1: online max and sum of exp over the vocabulary.
    m = float("-inf")
    d = 0.0
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    x_t = tl.load(ptr + tgt).to(tl.float32)
    loss = lse - x_t
    coef = 1.0
    if HAS_Z:
        loss += z_coef * lse * lse
        coef = 1.0 + 2.0 * z_coef * lse  # d(z lse^2)/dlogit = 2 z lse softmax
    scale = tl.load(SCALE).to(tl.float32)
    # Pass 2: overwrite the logits with dloss/dlogits.
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * coef
        g = tl.where(cols == tgt, g - 1.0, g) * scale
        tl.store(ptr + cols, g.to(LOGITS.dtype.element_ty), mask=mask)
    tl.store(LOSS + row, loss)


def _default_chunk(n_tokens: int, vocab: int, elt: int) -> int:
    rows = max(1, _CHUNK_BYTES // max(1, vocab * elt))
    chunk = 1 << (rows.bit_length() - 1)  # round down to a power of two
    return max(1, min(n_tokens, max(chunk, 16)))


def _flce_fwd_impl(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    ignore_index: int,
    z_loss: float,
    reduction: str,
    chunk_size: int,
    need_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    n, v = h2.shape[0], weight.shape[0]
    valid = (t != ignore_index).sum()
    if reduction == "mean":
        scale = (1.0 / valid.clamp(min=1).to(torch.float32)).reshape(1)
    else:
        scale = torch.ones(1, device=hidden.device, dtype=torch.float32)
    losses = torch.empty(n, device=hidden.device, dtype=torch.float32)
    grad_h = torch.empty_like(h2) if need_grad else h2.new_empty(0)
    grad_w = torch.zeros_like(weight) if need_grad else weight.new_empty(0)
    block_v = min(next_pow2(v), MAX_BLOCK_V)
    for start in range(0, n, chunk_size):
        hc = h2[start : start + chunk_size]
        logits = hc @ weight.t()
        _ce_grad_kernel[(hc.shape[0],)](
            logits, logits.stride(0), t[start : start + chunk_size], losses[start:],
            scale, v, ignore_index, z_loss,
            HAS_Z=z_loss != 0.0, BLOCK_V=block_v, num_warps=16 if block_v >= 8192 else 4,
        )  # fmt: skip
        if need_grad:
            torch.mm(logits, weight, out=grad_h[start : start + chunk_size])
            grad_w.addmm_(logits.t(), hc)
    loss = losses.sum() * scale[0]
    return loss, grad_h.view(hidden.shape) if need_grad else grad_h, grad_w


_flce_fwd = torch.library.custom_op("longboat::fused_linear_ce_fwd", mutates_args=())(
    _flce_fwd_impl
)


@_flce_fwd.register_fake
def _(hidden, weight, target, ignore_index, z_loss, reduction, chunk_size, need_grad):
    loss = hidden.new_empty((), dtype=torch.float32)
    if not need_grad:
        return loss, hidden.new_empty(0), weight.new_empty(0)
    return loss, hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


class _FusedLinearCEFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, target, ignore_index, z_loss, reduction, chunk_size, need_grad
    ):  # type: ignore[override]
        loss, gh, gw = op("fused_linear_ce_fwd", _flce_fwd_impl)(
            hidden, weight, target, ignore_index, z_loss, reduction, chunk_size, need_grad
        )
        ctx.save_for_backward(gh, gw)
        return loss

    @staticmethod
    def backward(ctx, dloss):  # type: ignore[override]
        gh, gw = ctx.saved_tensors
        # Scale in place: a second copy of the [vocab, hidden] weight gradient would double
        # the op's peak memory. (So backward runs once: no retain_graph double backward.)
        dloss = dloss.to(torch.float32)
        dh = gh.mul_(dloss) if ctx.needs_input_grad[0] else None
        dw = gw.mul_(dloss) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None, None, None, None


def fused_linear_cross_entropy_triton(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> Tensor:
    """Chunked Triton version, same signature as :func:`fused_linear_cross_entropy_torch`."""
    n = hidden.numel() // max(hidden.shape[-1], 1)
    chunk = chunk_size or _default_chunk(n, weight.shape[0], hidden.element_size())
    # Decided here: inside autograd.Function.forward grad mode is always off.
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearCEFn.apply(
        hidden, weight, target, ignore_index, float(z_loss), reduction, int(chunk), need_grad
    )


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    impl: str | None = None,
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``target`` (fp32 scalar loss).

    ``hidden``: ``[..., hidden]``; ``weight``: ``[vocab, hidden]``; ``target``: ``[...]`` ints.
    ``chunk_size``: tokens per logits chunk (default: ~1 GiB of logits).
    """
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(
            f"fused_linear_cross_entropy: weight {tuple(weight.shape)} must be "
            f"[vocab, {hidden.shape[-1]}] for hidden {tuple(hidden.shape)}"
        )
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"fused_linear_cross_entropy: target shape {tuple(target.shape)} must equal "
            f"hidden's leading dims {tuple(hidden.shape[:-1])}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f"fused_linear_cross_entropy: reduction={reduction!r}; use mean or sum")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_size={chunk_size} must be >= 1")
    kwargs = dict(ignore_index=ignore_index, z_loss=z_loss, reduction=reduction)
    if resolve_impl(impl, hidden) == "torch":
        return fused_linear_cross_entropy_torch(hidden, weight, target, **kwargs)
    return fused_linear_cross_entropy_triton(
        hidden, weight, target, chunk_size=chunk_size, **kwargs
    )
