"""AdaLN modulation fused with LayerNorm: ``layer_norm(x) * (1 + scale) + shift``.

As DiT / flow-matching action heads use it: ``x`` is ``[batch, seq, hidden]``, ``scale``
and ``shift`` are per sample (``[batch, hidden]`` or ``[batch, 1, hidden]``), the norm has
no affine parameters of its own. One pass over ``x`` forward, one backward (plus tiny
per-sample reductions for ``dscale``/``dshift``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longboat.kernels._dispatch import op, resolve_impl
from longboat.kernels.layernorm import group_norm_bwd, group_norm_fwd

Tensor = torch.Tensor


def ada_layer_norm_torch(x: Tensor, scale: Tensor, shift: Tensor, eps: float = 1e-6) -> Tensor:
    """Pure-torch reference of :func:`ada_layer_norm`."""
    b, _, d = x.shape
    s = scale.reshape(b, 1, d).float()
    t = shift.reshape(b, 1, d).float()
    return (F.layer_norm(x.float(), (d,), eps=eps) * (1 + s) + t).to(x.dtype)


def _ada_fwd_impl(
    x: Tensor, scale: Tensor, shift: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    b, s, d = x.shape
    return group_norm_fwd(x, scale.reshape(b, d), shift.reshape(b, d), s, eps, True)


_ada_fwd = torch.library.custom_op("longboat::ada_layer_norm_fwd", mutates_args=())(_ada_fwd_impl)


@_ada_fwd.register_fake
def _(x: Tensor, scale: Tensor, shift: Tensor, eps: float):
    stat = x.new_empty(x.shape[0] * x.shape[1], dtype=torch.float32)
    return x.new_empty(x.shape), stat, stat.new_empty(stat.shape)


def _ada_bwd_impl(
    dy: Tensor, x: Tensor, scale: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    b, s, d = x.shape
    dx, dscale, dshift = group_norm_bwd(dy, x, scale.reshape(b, d), mean, rstd, s, True, True)
    return dx, dscale.to(scale.dtype).view(scale.shape), dshift.to(scale.dtype).view(scale.shape)


_ada_bwd = torch.library.custom_op("longboat::ada_layer_norm_bwd", mutates_args=())(_ada_bwd_impl)


@_ada_bwd.register_fake
def _(dy: Tensor, x: Tensor, scale: Tensor, mean: Tensor, rstd: Tensor):
    return x.new_empty(x.shape), scale.new_empty(scale.shape), scale.new_empty(scale.shape)


class _AdaLNFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, shift, eps):  # type: ignore[override]
        y, mean, rstd = op("ada_layer_norm_fwd", _ada_fwd_impl)(x, scale, shift, eps)
        ctx.save_for_backward(x, scale, mean, rstd)
        ctx.shift_dtype = shift.dtype
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, scale, mean, rstd = ctx.saved_tensors
        dx, dscale, dshift = op("ada_layer_norm_bwd", _ada_bwd_impl)(
            dy.contiguous(), x, scale, mean, rstd
        )
        return dx, dscale, dshift.to(ctx.shift_dtype), None


def ada_layer_norm_triton(x: Tensor, scale: Tensor, shift: Tensor, eps: float = 1e-6) -> Tensor:
    """Triton AdaLN (fwd + bwd), same signature as :func:`ada_layer_norm_torch`."""
    return _AdaLNFn.apply(x, scale, shift, eps)


def ada_layer_norm(
    x: Tensor, scale: Tensor, shift: Tensor, eps: float = 1e-6, *, impl: str | None = None
) -> Tensor:
    """``layer_norm(x) * (1 + scale) + shift`` with per-sample ``scale``/``shift``."""
    if x.dim() != 3:
        raise ValueError(
            f"ada_layer_norm: x must be [batch, seq, hidden], got shape {tuple(x.shape)}; "
            "add a seq dim of 1 for one token per sample"
        )
    b, _, d = x.shape
    for name, t in (("scale", scale), ("shift", shift)):
        if t.shape not in ((b, d), (b, 1, d)):
            raise ValueError(
                f"ada_layer_norm: {name} shape {tuple(t.shape)} must be ({b}, {d}) or "
                f"({b}, 1, {d}) for x of shape {tuple(x.shape)}"
            )
    if resolve_impl(impl, x) == "torch":
        return ada_layer_norm_torch(x, scale, shift, eps)
    return ada_layer_norm_triton(x, scale, shift, eps)
