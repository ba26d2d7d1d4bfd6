"""FP8 GEMMs of an MoE layer's routed experts: ``y = x_e @ W[e]^T`` for every expert ``e``
over rows sorted by expert, forward, input gradient and weight gradient in FP8.

``x`` ``[T, K]`` holds every expert's rows one group after the other (``tokens_per_expert``
``[E]`` rows each), ``weight`` ``[E, N, K]`` every expert's projection. Every scale belongs to
one expert: an expert's activations, gradients and weights are quantised on their own, so a
large value routed to one expert never coarsens another's. Per recipe (``linear.RECIPES``):

- ``rowwise``: a scale per row of each operand, per expert. On CUDA with this torch's grouped
  FP8 GEMM (``torch.nn.functional.scaled_grouped_mm``, whose sm90 kernel takes e4m3 operands
  with fp32 row scales and writes bf16) the three GEMMs are grouped ones with the group ends
  computed on the device, so nothing waits for the host (``grouped`` backend). Forward and
  input gradient are ``[T, K] x [E, K, N]`` products (row scales of the tokens and of each
  expert's ``W`` / ``W^T``); the weight gradient contracts over each expert's tokens, so its
  operands ``dy^T`` / ``x^T`` get a scale per (expert, row) from that expert's tokens alone,
  and every group is zero-padded to 16 tokens (the grouped kernel's alignment) by a gather
  on the device.
- ``blockwise`` (1x128 tiles of each expert's tokens, 128x128 blocks of each ``W[e]``) and
  ``tensorwise`` (a scale per expert's operand): this torch has no grouped FP8 kernel for
  those scales on sm90, so each expert's three GEMMs run as ``fp8_mm`` products, one expert
  after the other (``looped`` backend; it reads the token counts on the host).

Off CUDA both backends are emulated (operands dequantised, fp32 products): the ``grouped``
one through ``torch.nn.functional.grouped_mm`` in fp32 on the dequantised operands, which is
how the CPU tests check the device layouts of its scales. ``LONGBOAT_FP8_GROUPED`` forces a
backend (``grouped`` / ``looped``) where the recipe allows it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from longboat.kernels.fp8.gemm import fp8_mm, resolve_gemm_backend
from longboat.kernels.fp8.linear import Fp8Recipe, _pad_tokens, _weight_t, get_recipe
from longboat.kernels.fp8.quantize import AMAX_FLOOR, E4M3, fp8_max, quantize

Tensor = torch.Tensor
GROUPED_BACKENDS = ("auto", "grouped", "looped")
ENV_VAR = "LONGBOAT_FP8_GROUPED"
GROUP_ALIGN = 16
"""Tokens per expert the weight-gradient operands are padded to a multiple of (the grouped
FP8 kernel's 16-byte alignment of the contraction dimension)."""
_SCALED_GROUPED_MM = getattr(F, "scaled_grouped_mm", None)
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def scaled_grouped_mm_available() -> bool:
    """Whether this torch has ``torch.nn.functional.scaled_grouped_mm``."""
    return _SCALED_GROUPED_MM is not None


def resolve_grouped_backend(backend: str | None, recipe: Fp8Recipe) -> str:
    """``grouped`` or ``looped`` (``backend`` > ``LONGBOAT_FP8_GROUPED`` > by recipe):
    ``grouped`` for the rowwise recipe where a grouped GEMM exists, ``looped`` otherwise."""
    choice = backend or os.environ.get(ENV_VAR) or "auto"
    if choice not in GROUPED_BACKENDS:
        raise ValueError(f"FP8 grouped backend {choice!r}: expected one of {GROUPED_BACKENDS}")
    rowwise = recipe.name == "rowwise" and recipe.grad_dtype == E4M3
    if choice == "grouped" and not rowwise:
        raise ValueError(
            f"the grouped FP8 expert GEMM takes the rowwise recipe, not {recipe.name!r}"
        )
    if choice == "auto":
        return "grouped" if rowwise and _GROUPED_MM is not None else "looped"
    return choice


# --- the looped backend: one fp8_mm per expert ------------------------------------------


def _looped_mm(
    a: Tensor,
    counts: list[int],
    a_dtype: torch.dtype,
    b_of: Any,
    n: int,
    activation: str,
    gemm: str,
) -> Tensor:
    """``a``'s rows of each expert (``counts``, in order) times that expert's operand
    ``b_of(e)`` (an ``Fp8Operand`` ``[n, K]``), one ``fp8_mm`` per expert with tokens."""
    out = a.new_zeros(a.shape[0], n)
    start = 0
    for e, c in enumerate(counts):
        if c:
            aq = quantize(a[start : start + c], activation, a_dtype)
            out[start : start + c] = fp8_mm(aq, b_of(e), out_dtype=a.dtype, backend=gemm)
        start += c
    return out


def _looped_forward(
    x: Tensor, weight: Tensor, counts: list[int], recipe: Fp8Recipe, gemm: str
) -> Tensor:
    def w(e: int) -> Any:
        return quantize(weight[e], recipe.weight, recipe.fwd_dtype)

    return _looped_mm(x, counts, recipe.fwd_dtype, w, weight.shape[1], recipe.activation, gemm)


def _looped_dgrad(
    dy: Tensor, weight: Tensor, counts: list[int], recipe: Fp8Recipe, gemm: str
) -> Tensor:
    def wt(e: int) -> Any:
        return _weight_t(weight[e], recipe)

    return _looped_mm(dy, counts, recipe.grad_dtype, wt, weight.shape[2], recipe.activation, gemm)


def _looped_wgrad(
    dy: Tensor, x: Tensor, weight: Tensor, counts: list[int], recipe: Fp8Recipe, gemm: str
) -> Tensor:
    dw = torch.zeros_like(weight)
    start = 0
    for e, c in enumerate(counts):
        if c:
            dyt, xt = dy[start : start + c].t(), x[start : start + c].t()
            if gemm == "scaled_mm":  # cuBLAS wants the contraction a multiple of 16
                dyt, xt = _pad_tokens(dyt, 16), _pad_tokens(xt, 16)
            dytq = quantize(dyt, recipe.wgrad, recipe.grad_dtype)
            xtq = quantize(xt, recipe.wgrad, recipe.fwd_dtype)
            dw[e] = fp8_mm(dytq, xtq, out_dtype=weight.dtype, backend=gemm)
        start += c
    return dw


# --- the grouped backend: rowwise scales, one grouped GEMM per product --------------------


def _rows_e4m3(t: Tensor) -> tuple[Tensor, Tensor]:
    """``t`` ``[rows, K]`` in e4m3 with a scale per row (``[rows]`` fp32)."""
    q = quantize(t, "row", E4M3)
    return q.data, q.scale.reshape(-1)


def _expert_rows_e4m3(w: Tensor) -> tuple[Tensor, Tensor]:
    """``w`` ``[E, R, C]`` in e4m3 with a scale per expert row (``[E, R]``)."""
    e, r, c = w.shape
    data, scale = _rows_e4m3(w.reshape(e * r, c))
    return data.view(e, r, c), scale.view(e, r)


def _group_columns_e4m3(t: Tensor, group: Tensor, experts: int) -> tuple[Tensor, Tensor]:
    """``t`` ``[T, C]`` in e4m3 with a scale per (expert, column) from that expert's rows
    (``group``: each row's expert); the scales ``[E, C]``."""
    fmax = fp8_max(E4M3)
    amax = t.new_zeros(experts, t.shape[1], dtype=torch.float32)
    index = group[:, None].expand(-1, t.shape[1])
    amax.scatter_reduce_(0, index, t.detach().abs().float(), reduce="amax")
    scale = amax.clamp(min=AMAX_FLOOR) / fmax
    data = (t.float() / scale[group]).clamp(-fmax, fmax).to(E4M3)
    return data, scale


def _padded_rows(counts: Tensor, total: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """Where each of ``total`` rows sorted by expert goes when every expert's group is
    zero-padded to ``GROUP_ALIGN`` rows: each row's expert, each row's padded index, the
    padded groups' int32 ends, and the padded length (a bound known without reading the
    counts, so nothing waits for the device)."""
    experts = counts.shape[0]
    ends = torch.cumsum(counts, 0)
    group = torch.bucketize(torch.arange(total, device=counts.device), ends, right=True)
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    padded_ends = torch.cumsum(padded, 0)
    index = torch.arange(total, device=counts.device) - (ends - counts)[group]
    index = index + (padded_ends - padded)[group]
    length = -(-(total + (GROUP_ALIGN - 1) * experts) // GROUP_ALIGN) * GROUP_ALIGN
    return group, index, padded_ends.to(torch.int32), length


def _grouped_mm_fp8(
    a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, offs: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``scaled_grouped_mm`` of ``a`` (row-major) and ``b`` (column-major) with row scales
    on CUDA; elsewhere the emulation: both dequantised, fp32 ``grouped_mm``."""
    if a.is_cuda:
        rowwise = F.ScalingType.RowWise  # type: ignore[attr-defined]
        return _SCALED_GROUPED_MM(  # type: ignore[misc]
            a, b, sa, rowwise, sb, rowwise, offs=offs, output_dtype=torch.bfloat16
        ).to(out_dtype)
    af = a.float() * _expand_a(sa, a, b, offs)
    bf = b.float() * _expand_b(sb, a, b, offs)
    return _GROUPED_MM(af, bf, offs=offs).to(out_dtype)  # type: ignore[misc]


def _expand_a(sa: Tensor, a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    if b.dim() == 3:  # 2d x 3d: a scale per row of a
        return sa[:, None]
    # 2d x 2d (contraction split by offs): a scale per (group, row of a) over each group's
    # columns of a
    rows, cols = a.shape
    group = torch.bucketize(torch.arange(cols, device=a.device), offs, right=True)
    scale = sa.view(-1, rows)
    scale = torch.cat([scale, scale.new_ones(1, rows)])  # columns past the last group
    return scale[group].t()


def _expand_b(sb: Tensor, a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    if b.dim() == 3:  # [E, K, N]: a scale per (expert, column of b)
        return sb[:, None, :]
    rows, cols = b.shape  # [T, N], contraction over T
    group = torch.bucketize(torch.arange(rows, device=b.device), offs, right=True)
    scale = sb.view(-1, cols)
    scale = torch.cat([scale, scale.new_ones(1, cols)])
    return scale[group]


def _grouped_forward(x: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    xq, sx = _rows_e4m3(x)
    wq, sw = _expert_rows_e4m3(weight)  # [E, N, K], scales [E, N]
    return _grouped_mm_fp8(xq, sx, wq.transpose(1, 2), sw, ends, x.dtype)


def _grouped_dgrad(dy: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    dyq, sdy = _rows_e4m3(dy)
    wtq, swt = _expert_rows_e4m3(weight.transpose(1, 2))  # W^T [E, K, N], scales [E, K]
    return _grouped_mm_fp8(dyq, sdy, wtq.transpose(1, 2), swt, ends, dy.dtype)


def _scatter_rows(t: Tensor, index: Tensor, length: int) -> Tensor:
    """``[length, C]`` zeros with ``t``'s rows at ``index`` (FP8 moved as its bytes; a zero
    byte is e4m3's zero)."""
    out = torch.zeros(length, t.shape[1], dtype=torch.uint8, device=t.device)
    return out.index_copy_(0, index, t.view(torch.uint8)).view(t.dtype)


def _grouped_wgrad(dy: Tensor, x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    experts, n, k = weight.shape
    group, index, padded_ends, length = _padded_rows(counts, x.shape[0])
    dyq, sdy = _group_columns_e4m3(dy, group, experts)  # scales [E, N]
    xq, sx = _group_columns_e4m3(x, group, experts)  # scales [E, K]
    a = _scatter_rows(dyq, index, length)  # padded dy
    b = _scatter_rows(xq, index, length)  # padded x
    a = a.t().contiguous()  # dy^T [N, P] row-major
    b = b.t().contiguous().t()  # x [P, K] column-major
    out = _grouped_mm_fp8(a, sdy.reshape(-1), b, sx.reshape(-1), padded_ends, weight.dtype)
    return out.view(experts, n, k)


# --- the autograd function ---------------------------------------------------------------


class _Fp8GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, counts: Tensor, recipe: Fp8Recipe, backend: str
    ) -> Tensor:
        counts = counts.to(device=x.device, dtype=torch.long)
        if backend == "grouped":
            host = None
            y = _grouped_forward(x, weight, torch.cumsum(counts, 0, dtype=torch.int32))
        else:
            host = counts.tolist()
            gemm = resolve_gemm_backend(None, x, weight)
            y = _looped_forward(x, weight, host, recipe, gemm)
        ctx.save_for_backward(x, weight, counts)
        ctx.meta = (recipe, backend, host)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor):  # type: ignore[override]
        x, weight, counts = ctx.saved_tensors
        recipe, backend, host = ctx.meta
        dy = dy.contiguous()
        needs = ctx.needs_input_grad
        dx = dw = None
        if backend == "grouped":
            if needs[0]:
                dx = _grouped_dgrad(dy, weight, torch.cumsum(counts, 0, dtype=torch.int32))
            if needs[1]:
                dw = _grouped_wgrad(dy, x, weight, counts)
        else:
            gemm = resolve_gemm_backend(None, x, weight)
            if needs[0]:
                dx = _looped_dgrad(dy, weight, host, recipe, gemm)
            if needs[1]:
                dw = _looped_wgrad(dy, x, weight, host, recipe, gemm)
        return dx, dw, None, None, None


def fp8_grouped_linear(
    x: Tensor,
    weight: Tensor,
    tokens_per_expert: Tensor,
    *,
    recipe: str | Fp8Recipe = "blockwise",
    backend: str | None = None,
) -> Tensor:
    """Every expert's ``x_e @ weight[e]^T`` (``x`` ``[T, K]`` sorted by expert,
    ``tokens_per_expert`` ``[E]`` rows each, ``weight`` ``[E, N, K]``): ``[T, N]`` in x's dtype,
    the forward, input-gradient and weight-gradient GEMMs in FP8 with per-expert scales of
    ``recipe`` and fp32 accumulation (module doc). ``backend``: ``grouped`` (rowwise only) or
    ``looped``; default by recipe."""
    r = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(
            f"fp8_grouped_linear: x [T, K] and weight [E, N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    resolved = resolve_grouped_backend(backend, r)
    if resolved == "grouped" and x.is_cuda and _SCALED_GROUPED_MM is None:
        resolved = "looped"  # a torch without the grouped FP8 GEMM
    return _Fp8GroupedLinearFn.apply(x, weight, tokens_per_expert, r, resolved)


def high_precision_grouped_linear(x: Tensor, weight: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """``fp8_grouped_linear``'s product in x's dtype (the adaptive recipe's bf16 choice): one
    grouped GEMM where this torch has one for the operands, else one GEMM per expert."""
    aligned = all((d * x.element_size()) % 16 == 0 for d in weight.shape[1:])
    if _GROUPED_MM is not None and aligned and (not x.is_cuda or x.dtype == torch.bfloat16):
        ends = torch.cumsum(tokens_per_expert.to(x.device), 0, dtype=torch.int32)
        return _GROUPED_MM(x, weight.transpose(1, 2), offs=ends)
    parts = torch.split(x, tokens_per_expert.tolist())
    return torch.cat([p @ w.t() for p, w in zip(parts, weight, strict=True)])


__all__ = [
    "ENV_VAR",
    "GROUPED_BACKENDS",
    "GROUP_ALIGN",
    "fp8_grouped_linear",
    "high_precision_grouped_linear",
    "resolve_grouped_backend",
    "scaled_grouped_mm_available",
]
