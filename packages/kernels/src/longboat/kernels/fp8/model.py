"""What a built model runs in FP8, for any stack: its kernel linears (modules with a
``linear_fn``, core's ``KernelColumn/RowParallelLinear``) and grouped MoE experts (modules with
a ``grouped_linear_fn``, core's ``GroupedExperts``), found by those attributes so that no
megatron import is needed; the adaptive recipe's decisions at the run's shapes; the run's line
about it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def kernel_linears(modules: Iterable[torch.nn.Module]) -> list[Any]:
    """Every kernel linear of ``modules`` (each module's whole tree)."""
    return [m for root in modules for m in root.modules() if hasattr(m, "linear_fn")]


def grouped_experts(modules: Iterable[torch.nn.Module]) -> list[Any]:
    """Every grouped-experts module of ``modules`` (each module's whole tree)."""
    return [m for root in modules for m in root.modules() if hasattr(m, "grouped_linear_fn")]


def decide_adaptive(modules: Iterable[torch.nn.Module], tokens: int, device: torch.device) -> str:
    """``train.fp8.recipe=adaptive``: FP8 or bf16 for every kernel linear's shape
    ``(tokens, out, in)``, measured on ``device`` before the first step (or read from the timing
    cache); the decisions as a table ("" where no linear runs the adaptive function)."""
    by_fn: dict[int, tuple[Any, set[tuple[int, int, int]]]] = {}
    for m in kernel_linears(modules):
        if m.linear_fn is not None and hasattr(m.linear_fn, "decide"):
            entry = by_fn.setdefault(id(m.linear_fn), (m.linear_fn, set()))
            entry[1].add((tokens, *m.weight.shape))
    return "\n".join(fn.decide(sorted(shapes), device) for fn, shapes in by_fn.values())


KEPT = "the first and last layers, embeddings, output head, router and norms"
"""What a decoder keeps in bf16 under FP8 (``fp8_summary``'s default)."""


def fp8_summary(modules: Iterable[torch.nn.Module], recipe: str, table: str = "", *,
                what: str = "decoder linears", kept: str = KEPT) -> str:  # fmt: skip
    """One line: how many of the kernel linears (``what`` they are) and of the grouped MoE
    experts run their GEMMs in FP8 with ``recipe``, and what stays in bf16 (``kept``);
    ``table``: the adaptive decisions, appended."""
    modules = list(modules)
    linears = kernel_linears(modules)
    on = sum(m.linear_fn is not None for m in linears)
    experts = grouped_experts(modules)
    grouped = ""
    if experts:
        on_e = sum(m.grouped_linear_fn is not None for m in experts)
        grouped = f", {on_e} of {len(experts)} layers' grouped MoE experts"
    line = f"FP8 ({recipe}): {on} of {len(linears)} {what}{grouped}; {kept} in bf16."
    if table:
        line += " Per shape (tokens x out x in), ms of a forward + backward:\n" + table
    return line


__all__ = ["KEPT", "decide_adaptive", "fp8_summary", "grouped_experts", "kernel_linears"]
