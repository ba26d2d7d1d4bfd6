"""An MLP's down projection in FP8 with the gated activation of its input fused in.

``fp8_glu_linear(h, W) = fp8_linear(glu(h), W)`` for the packed fc1 output ``h``
``[..., 2C]`` (gate first). Where the recipe quantises activations in 1x128 tiles along
both dimensions (``blockwise``), the activation ``a = act(gate) * up`` is never written in
bf16: ``glu_quantize_dual`` writes the forward GEMM's operand of ``a`` and the weight
gradient's operand of ``a^T`` directly (``glu_quant``). The backward is the FP8 linear's
(``linear.fp8_linear_backward``) followed by the GLU's backward kernel on ``h``, which is
what is saved (as the unfused GLU saves it) beside ``a^T``'s FP8 operand and ``W``.

Same results as the unfused pair, bit for bit (same codes, scales, GEMMs and backward
kernels). Elsewhere (another recipe, the torch path, a frozen weight or no autograd, a
token count cuBLAS cannot take in the one-pass layout) it runs the unfused pair, and so it
does everywhere with ``LONGBOAT_FP8_FUSE_GLU=0`` in the environment (to measure the fusion
against the pair in a whole run).
"""

from __future__ import annotations

import os

import torch

from longboat.kernels._dispatch import op, resolve_impl
from longboat.kernels.fp8.gemm import fp8_mm, output_supported, resolve_gemm_backend
from longboat.kernels.fp8.glu_quant import glu_quantize_dual
from longboat.kernels.fp8.linear import (
    Fp8Recipe,
    WgradHook,
    _dual_ok,
    fp8_linear,
    fp8_linear_backward,
    get_recipe,
)
from longboat.kernels.fp8.quantize import Fp8Operand, quantize
from longboat.kernels.swiglu import _ACTS, _glu_bwd_impl, glu

Tensor = torch.Tensor
FUSE_ENV = "LONGBOAT_FP8_FUSE_GLU"
"""Set to ``0``: ``fp8_glu_linear`` always runs the unfused pair."""


class _Fp8GLULinearFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: object,
        h: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        recipe: Fp8Recipe,
        wgrad_hook: WgradHook | None,
        wgrad_dtype: torch.dtype | None,
        backend: str,
        act: int,
    ) -> Tensor:
        aq, atq = glu_quantize_dual(h, _ACTS[act], recipe.fwd_dtype, impl="triton")
        ctx.save_for_backward(h, atq.data, atq.scale, weight)  # type: ignore[attr-defined]
        wq = quantize(weight, recipe.weight, recipe.fwd_dtype)
        y = fp8_mm(aq, wq, out_dtype=h.dtype, bias=bias, backend=backend)
        ctx.meta = (recipe, wgrad_hook, wgrad_dtype, backend, bias is not None, act)  # type: ignore[attr-defined]
        return y.view(*h.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: object, dy: Tensor):  # type: ignore[override]
        recipe, hook, wgrad_dtype, backend, has_bias, act = ctx.meta  # type: ignore[attr-defined]
        h, at_data, at_scale, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        dy2, da, dw = fp8_linear_backward(
            dy, weight, Fp8Operand(at_data, at_scale, recipe.wgrad), recipe, backend,
            needs_dx=needs[0], needs_dw=needs[1], x_dtype=h.dtype, hook=hook, wgrad_dtype=wgrad_dtype,
        )  # fmt: skip
        dh = None
        if da is not None:
            dh, _ = op("glu_bwd", _glu_bwd_impl)(da, h, None, act)
        db = dy2.sum(dim=0) if has_bias and needs[2] else None
        return dh, dw, db, None, None, None, None, None


def fused_applies(h: Tensor, weight: Tensor, recipe: Fp8Recipe, backend: str, impl: str | None = None) -> bool:  # fmt: skip
    """Whether ``fp8_glu_linear`` runs fused (module doc): a 1x128 recipe for both the
    activation and the weight-gradient operands, the Triton path, a weight gradient to come
    (autograd on, the weight trainable), a token count the one-pass layout serves, and
    ``LONGBOAT_FP8_FUSE_GLU`` not ``0``."""
    tokens = h.numel() // h.shape[-1]
    return (
        os.environ.get(FUSE_ENV, "1") != "0"
        and torch.is_grad_enabled()
        and weight.requires_grad
        and _dual_ok(recipe, tokens, backend)
        and resolve_impl(impl, h) == "triton"
    )


def fp8_glu_linear(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    recipe: str | Fp8Recipe = "blockwise",
    activation: str = "silu",
    wgrad_hook: WgradHook | None = None,
    wgrad_dtype: torch.dtype | None = None,
    backend: str | None = None,
    impl: str | None = None,
) -> Tensor:
    """``fp8_linear(glu(h, activation=activation), weight, bias, ...)`` for the packed
    ``h`` ``[..., 2C]`` (gate first; ``weight`` ``[N, C]``), with the activation written
    straight as the GEMMs' FP8 operands where the recipe allows (module doc). Arguments as
    in ``fp8_linear``; ``impl`` as in ``longboat.kernels`` (the fused kernel is Triton)."""
    if activation not in _ACTS:
        raise ValueError(f"fp8_glu_linear: activation={activation!r} is not one of {_ACTS}")
    if h.shape[-1] != 2 * weight.shape[1]:
        raise ValueError(
            f"fp8_glu_linear: packed input {tuple(h.shape)} needs a last dim of 2 x the "
            f"weight's in-features ({weight.shape[1]})"
        )
    r = get_recipe(recipe) if isinstance(recipe, str) else recipe
    resolved = resolve_gemm_backend(backend, h, weight)
    if not fused_applies(h, weight, r, resolved, impl):
        a = glu(h, activation=activation, impl=impl)
        return fp8_linear(a, weight, bias, recipe=r, wgrad_hook=wgrad_hook,
                          wgrad_dtype=wgrad_dtype, backend=resolved)  # fmt: skip
    if (
        wgrad_dtype is not None
        and resolved == "scaled_mm"
        and not output_supported(r.wgrad, r.wgrad, wgrad_dtype, h.device)
    ):
        wgrad_dtype = h.dtype  # as fp8_linear: this cuBLAS writes only h's dtype for the pair
    return _Fp8GLULinearFn.apply(
        h, weight, bias, r, wgrad_hook, wgrad_dtype, resolved, _ACTS.index(activation)
    )


__all__ = ["FUSE_ENV", "fp8_glu_linear", "fused_applies"]
