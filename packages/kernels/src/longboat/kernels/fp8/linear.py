"""A linear layer whose three GEMMs (forward, input gradient, weight gradient) run in FP8.

``y = x W^T (+ b)`` with ``x`` ``[..., K]`` and ``W`` ``[N, K]`` in bf16 (or fp32). Each GEMM is
``fp8_mm(A, B)`` of operands quantised along its contraction dimension, accumulated in
fp32, written in x's dtype:

=========  ====================  =====================  ======================
GEMM       A                     B                      contraction
=========  ====================  =====================  ======================
forward    ``x`` ``[M, K]``      ``W`` ``[N, K]``       K
dgrad      ``dy`` ``[M, N]``     ``W^T`` ``[K, N]``     N
wgrad      ``dy^T`` ``[N, M]``   ``x^T`` ``[K, M]``     M (tokens)
=========  ====================  =====================  ======================

Recipes (``RECIPES``), the granularity of A / B per GEMM:

- ``blockwise`` (DeepSeek-V3): activations and gradients in 1x128 tiles, weights in 128x128
  blocks (so ``W^T``'s blocks are ``W``'s, re-read transposed); the wgrad operands in 1x128
  tiles along the tokens. Everything e4m3: with a scale per 128 values the gradients' range
  fits e4m3's, and its extra mantissa bit halves the rounding error of e5m2.
- ``rowwise``: one scale per row of every operand (``W^T``'s rows are ``W``'s columns); e4m3
  throughout, for the same reason (a scale per row follows the gradients' range).
- ``tensorwise`` (current scaling): one scale per tensor, computed from the tensor itself
  each step; e4m3 forward, e5m2 gradients (one scale must cover the whole gradient's range).

What is saved for backward: with a 1x128 recipe (``blockwise``), ``x^T``'s FP8 operand for
the weight gradient, quantised in the forward from the same read as ``x``'s (one byte a
value instead of two; the same codes the backward would make), and ``W``; otherwise ``x``
and ``W`` in their own dtype, quantised again in the backward along the other dimension.
The backward quantises ``dy`` for both of its GEMMs in one pass where the recipe allows. A weight gradient
can go to a hook instead of autograd (``wgrad_hook``: megatron's accumulation into
``main_grad``), computed in fp32 where ``wgrad_dtype`` says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from longboat.kernels.fp8.gemm import fp8_mm, output_supported, resolve_gemm_backend
from longboat.kernels.fp8.quantize import (
    E4M3,
    E5M2,
    Fp8Operand,
    quantize,
    quantize_blocks_transposed,
    quantize_dual,
)

Tensor = torch.Tensor
WgradHook = Callable[[Tensor], Tensor | None]
"""``hook(dW)`` -> what autograd receives as the weight's gradient (None, or a stand-in)."""


@dataclass(frozen=True)
class Fp8Recipe:
    """How each operand of the three GEMMs is scaled, and in which FP8 format."""

    name: str
    activation: str
    """Granularity of ``x`` (forward) and ``dy`` (dgrad)."""
    weight: str
    """Granularity of ``W`` (forward) and ``W^T`` (dgrad)."""
    wgrad: str
    """Granularity of ``dy^T`` and ``x^T`` in the weight-gradient GEMM."""
    grad_dtype: torch.dtype
    """FP8 format of the output gradient ``dy``."""
    fwd_dtype: torch.dtype = E4M3
    """FP8 format of ``x`` and ``W``."""


RECIPES: dict[str, Fp8Recipe] = {
    "blockwise": Fp8Recipe("blockwise", "1x128", "128x128", "1x128", E4M3),
    "rowwise": Fp8Recipe("rowwise", "row", "row", "row", E4M3),
    "tensorwise": Fp8Recipe("tensorwise", "tensor", "tensor", "tensor", E5M2),
}
"""The FP8 recipes by name (module doc)."""


def get_recipe(name: str) -> Fp8Recipe:
    """The recipe ``name``; ValueError naming the choices otherwise."""
    if name not in RECIPES:
        raise ValueError(f"FP8 recipe {name!r}: expected one of {sorted(RECIPES)}")
    return RECIPES[name]


def _pad_tokens(t: Tensor, multiple: int) -> Tensor:
    """``t`` ``[rows, M]`` with M zero-padded to a multiple (zeros add nothing to dy^T x)."""
    extra = -t.shape[1] % multiple
    return t if extra == 0 else torch.nn.functional.pad(t, (0, extra))


def _dual_ok(recipe: Fp8Recipe, tokens: int, backend: str) -> bool:
    """Whether one pass can quantise an activation (or gradient) for both of its GEMMs: the
    recipe tiles both along 128 values, and cuBLAS gets a token count that is a multiple of
    16 (else the weight-gradient operands are padded first, the unfused way)."""
    return (
        recipe.activation == "1x128"
        and recipe.wgrad == "1x128"
        and (backend != "scaled_mm" or tokens % 16 == 0)
    )


def _weight_t(weight: Tensor, recipe: Fp8Recipe) -> Fp8Operand:
    """``W^T``'s operand for the input-gradient GEMM."""
    if recipe.weight == "128x128":  # W's own blocks, written transposed from a row-major read
        return quantize_blocks_transposed(weight, recipe.fwd_dtype)
    return quantize(weight.t(), recipe.weight, recipe.fwd_dtype)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: object,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        recipe: Fp8Recipe,
        wgrad_hook: WgradHook | None,
        wgrad_dtype: torch.dtype | None,
        backend: str,
    ) -> Tensor:
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        # With a weight gradient to come and a 1x128 recipe, x^T's operand is made now from the
        # same read and saved instead of x (half its bytes, the same codes as in the backward).
        dual = ctx.needs_input_grad[1] and _dual_ok(recipe, x2.shape[0], backend)  # type: ignore[attr-defined]
        if dual:
            xq, xtq = quantize_dual(x2, recipe.fwd_dtype)
            ctx.save_for_backward(xtq.data, xtq.scale, weight)  # type: ignore[attr-defined]
        else:
            xq = quantize(x2, recipe.activation, recipe.fwd_dtype)
            ctx.save_for_backward(x2, weight)  # type: ignore[attr-defined]
        wq = quantize(weight, recipe.weight, recipe.fwd_dtype)
        y = fp8_mm(xq, wq, out_dtype=x.dtype, bias=bias, backend=backend)
        ctx.meta = (
            recipe,
            wgrad_hook,
            wgrad_dtype,
            backend,
            bias is not None,
            dual,
            x.shape,
            x.dtype,
        )  # type: ignore[attr-defined]
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: object, dy: Tensor):  # type: ignore[override]
        recipe, hook, wgrad_dtype, backend, has_bias, dual, x_shape, x_dtype = ctx.meta  # type: ignore[attr-defined]
        saved = ctx.saved_tensors  # type: ignore[attr-defined]
        weight = saved[-1]
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        if dual:
            x_saved: Tensor | Fp8Operand = Fp8Operand(saved[0], saved[1], recipe.wgrad)
        else:
            x_saved = saved[0]
        dy2, dx, dw = fp8_linear_backward(
            dy, weight, x_saved, recipe, backend,
            needs_dx=needs[0], needs_dw=needs[1], x_dtype=x_dtype, hook=hook, wgrad_dtype=wgrad_dtype,
        )  # fmt: skip
        dx = None if dx is None else dx.view(x_shape)
        db = dy2.sum(dim=0) if has_bias and needs[2] else None
        return dx, dw, db, None, None, None, None


def fp8_linear_backward(
    dy: Tensor,
    weight: Tensor,
    x_saved: Tensor | Fp8Operand,
    recipe: Fp8Recipe,
    backend: str,
    *,
    needs_dx: bool,
    needs_dw: bool,
    x_dtype: torch.dtype,
    hook: WgradHook | None = None,
    wgrad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The FP8 linear's input- and weight-gradient GEMMs: ``(dy2, dx2, dw)`` with ``dy2``
    ``dy`` as ``[M, N]``, ``dx2`` ``[M, K]`` in ``x_dtype`` (None unless ``needs_dx``) and
    ``dw`` what autograd gets for the weight (through ``hook`` where given; None unless
    ``needs_dw``). ``x_saved``: the forward's input ``[M, K]``, or ``x^T``'s wgrad operand
    where the forward made it (``quantize_dual``, or a producer that quantised its output)."""
    dy2 = dy.reshape(-1, weight.shape[0])
    dx = dw = None
    dyq = dytq = None
    if needs_dx and needs_dw and _dual_ok(recipe, dy2.shape[0], backend):
        dyq, dytq = quantize_dual(dy2, recipe.grad_dtype)
    if needs_dx:
        if dyq is None:
            dyq = quantize(dy2, recipe.activation, recipe.grad_dtype)
        dx = fp8_mm(dyq, _weight_t(weight, recipe), out_dtype=x_dtype, backend=backend)
    if needs_dw:
        if isinstance(x_saved, Fp8Operand):
            xtq = x_saved
        else:
            xt = x_saved.reshape(-1, weight.shape[1]).t()
            if backend == "scaled_mm":  # cuBLAS wants the contraction a multiple of 16
                xt = _pad_tokens(xt, 16)
            xtq = quantize(xt, recipe.wgrad, recipe.fwd_dtype)
        if dytq is None:
            dyt = dy2.t()
            if backend == "scaled_mm":
                dyt = _pad_tokens(dyt, 16)
            dytq = quantize(dyt, recipe.wgrad, recipe.grad_dtype)
        dw = fp8_mm(dytq, xtq, out_dtype=wgrad_dtype or weight.dtype, backend=backend)
        if hook is not None:
            dw = hook(dw)
        elif dw.dtype != weight.dtype:
            dw = dw.to(weight.dtype)
    return dy2, dx, dw


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    recipe: str | Fp8Recipe = "blockwise",
    wgrad_hook: WgradHook | None = None,
    wgrad_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> Tensor:
    """``x @ weight^T + bias`` with the forward, input-gradient and weight-gradient GEMMs in
    FP8 (``recipe``: a name of ``RECIPES`` or an ``Fp8Recipe``), fp32 accumulation, outputs in
    x's dtype. ``wgrad_hook``: receives the weight gradient (in ``wgrad_dtype``, default the
    weight's) and returns what autograd gets for the weight. ``backend``: ``scaled_mm``
    (CUDA) or ``emulated`` (dequantise + fp32 matmul; CPU), default by device."""
    r = get_recipe(recipe) if isinstance(recipe, str) else recipe
    resolved = resolve_gemm_backend(backend, x, weight)
    if (
        wgrad_dtype is not None
        and resolved == "scaled_mm"
        and not output_supported(r.wgrad, r.wgrad, wgrad_dtype, x.device)
    ):
        wgrad_dtype = x.dtype  # this cuBLAS writes only x's dtype for the pair
    return _Fp8LinearFn.apply(x, weight, bias, r, wgrad_hook, wgrad_dtype, resolved)


class _HighPrecisionLinearFn(torch.autograd.Function):
    """The same linear with its GEMMs in x's dtype: the bf16 choice of the adaptive recipe,
    with the same ``wgrad_hook`` contract as the FP8 one."""

    @staticmethod
    def forward(ctx: object, x: Tensor, weight: Tensor, bias: Tensor | None,
                wgrad_hook: WgradHook | None, wgrad_dtype: torch.dtype | None) -> Tensor:  # type: ignore[override]  # fmt: skip
        ctx.save_for_backward(x, weight)  # type: ignore[attr-defined]
        ctx.meta = (wgrad_hook, wgrad_dtype, bias is not None)  # type: ignore[attr-defined]
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: object, dy: Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        hook, wgrad_dtype, has_bias = ctx.meta  # type: ignore[attr-defined]
        n, k = weight.shape
        dy2 = dy.reshape(-1, n)
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        dx = (dy2 @ weight).view(x.shape) if needs[0] else None
        dw = db = None
        if needs[1]:
            x2 = x.reshape(-1, k)
            if wgrad_dtype == torch.float32 and dy2.is_cuda and x2.dtype != torch.float32:
                dw = torch.mm(dy2.t(), x2, out_dtype=torch.float32)
            else:
                dw = (dy2.t() @ x2).to(wgrad_dtype or weight.dtype)
            if hook is not None:
                dw = hook(dw)
            elif dw.dtype != weight.dtype:
                dw = dw.to(weight.dtype)
        if has_bias and needs[2]:
            db = dy2.sum(dim=0)
        return dx, dw, db, None, None


def high_precision_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    wgrad_hook: WgradHook | None = None,
    wgrad_dtype: torch.dtype | None = None,
) -> Tensor:
    """``x @ weight^T + bias`` in x's dtype with ``fp8_linear``'s ``wgrad_hook`` contract."""
    return _HighPrecisionLinearFn.apply(x, weight, bias, wgrad_hook, wgrad_dtype)


__all__ = [
    "RECIPES",
    "Fp8Recipe",
    "WgradHook",
    "fp8_linear",
    "fp8_linear_backward",
    "get_recipe",
    "high_precision_linear",
]
