"""The ``LinearFn`` a decoder layer's linears run on for ``train.precision=fp8``.

``fp8_linear_fn(recipe)`` returns ``fn(x, weight, bias, *, wgrad_hook=None, wgrad_dtype=None)``
(core's ``LayerKernels.linear`` contract): ``fp8_linear`` with the recipe, or for
``adaptive`` the choice of an ``AdaptiveChooser`` per ``(tokens, out, in)`` shape: FP8 in the
fastest recipe where it beats bf16 on this GPU by the chooser's margin, bf16 elsewhere
(``AdaptiveLinear``: a run decides its shapes at start with ``decide``; a shape first seen
in a call is decided then). ``fp8_glu_linear_fn(recipe)``: the MLP down projection with
the SwiGLU of its input fused in (core's ``LayerKernels.glu_linear``; ``blockwise`` only).
``fp8_grouped_linear_fn(recipe)`` is the same for the grouped MoE
experts (core's ``GroupedLinearFn``: ``fp8_grouped_linear`` with per-expert scales).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from longboat.kernels.fp8.adaptive import HIGH_PRECISION, AdaptiveChooser, TimingCache
from longboat.kernels.fp8.linear import RECIPES, fp8_linear, high_precision_linear

LOG = logging.getLogger("longboat.kernels.fp8")
ADAPTIVE = "adaptive"


class AdaptiveLinear:
    """The ``adaptive`` recipe's ``LinearFn``: per ``(tokens, out, in)`` shape, FP8 in the
    fastest recipe or bf16 (an ``AdaptiveChooser`` per device). ``decide`` settles a run's
    shapes up front (a short calibration at start, or the cache) and returns the table; a
    shape first seen in a call is decided then, and logged."""

    def __init__(self) -> None:
        self.choosers: dict[torch.device, AdaptiveChooser] = {}

    def chooser(self, device: torch.device) -> AdaptiveChooser:
        """This device's chooser (its GPU name keys the timing cache)."""
        if device not in self.choosers:
            from longboat.core.device import get_accelerator
            from longboat.kernels.fp8.adaptive import measure_linear

            gpu = get_accelerator().device_name() if device.type != "cpu" else "cpu"

            def measure(shape: tuple[int, int, int], names: tuple[str, ...]) -> dict[str, float]:
                return measure_linear(shape, names, device=device)

            self.choosers[device] = AdaptiveChooser(gpu, cache=TimingCache.load(), measure=measure)
        return self.choosers[device]

    def decide(self, shapes: list[tuple[int, int, int]], device: torch.device) -> str:
        """Decide every shape (measuring those the cache lacks); the decisions as a table."""
        chooser = self.chooser(device)
        for shape in shapes:
            chooser.choice(shape)
        return chooser.table()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:  # fmt: skip
        chooser = self.chooser(x.device)
        shape = (x.numel() // x.shape[-1], weight.shape[0], weight.shape[1])
        known = shape in chooser.decisions
        picked = chooser.choice(shape)
        if not known:
            LOG.info("fp8 adaptive on %s:\n%s", chooser.gpu, chooser.table())
        if picked == HIGH_PRECISION:
            return high_precision_linear(x, weight, bias, **kw)
        return fp8_linear(x, weight, bias, recipe=picked, **kw)


class GroupedFp8Linear:
    """The ``GroupedLinearFn`` of a fixed recipe: ``fp8_grouped_linear`` (per-expert scales).
    ``waits_for_host``: whether its backend reads the token counts on the host (the looped
    one: a CUDA-graph capture cannot hold it)."""

    def __init__(self, recipe: str) -> None:
        from longboat.kernels.fp8.grouped import resolve_grouped_backend
        from longboat.kernels.fp8.linear import get_recipe

        self.recipe = recipe
        self.waits_for_host = resolve_grouped_backend(None, get_recipe(recipe)) == "looped"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:  # fmt: skip
        from longboat.kernels.fp8.grouped import fp8_grouped_linear

        return fp8_grouped_linear(x, weight, tokens_per_expert, recipe=self.recipe)


class AdaptiveGroupedLinear:
    """The ``adaptive`` recipe's ``GroupedLinearFn``: FP8 in the recipe, or bf16, that the
    dense linears' chooser (``AdaptiveLinear``) picks for an expert's mean GEMM,
    ``(tokens // experts, out, in)``; decided on first call and logged."""

    waits_for_host = True  # a looped recipe may be picked

    def __init__(self, dense: AdaptiveLinear) -> None:
        self.dense = dense

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:  # fmt: skip
        from longboat.kernels.fp8.grouped import fp8_grouped_linear, high_precision_grouped_linear

        chooser = self.dense.chooser(x.device)
        shape = (max(1, x.shape[0] // weight.shape[0]), weight.shape[1], weight.shape[2])
        known = shape in chooser.decisions
        picked = chooser.choice(shape)
        if not known:
            LOG.info("fp8 adaptive (MoE experts) on %s:\n%s", chooser.gpu, chooser.table())
        if picked == HIGH_PRECISION:
            return high_precision_grouped_linear(x, weight, tokens_per_expert)
        return fp8_grouped_linear(x, weight, tokens_per_expert, recipe=picked)


def fp8_grouped_linear_fn(recipe: str, dense: Any = None) -> Any:
    """The MoE experts' ``GroupedLinearFn`` of ``recipe`` (``adaptive``: sharing the chooser of
    ``dense``, the layers' ``AdaptiveLinear``, or a new one)."""
    if recipe == ADAPTIVE:
        return AdaptiveGroupedLinear(
            dense if isinstance(dense, AdaptiveLinear) else AdaptiveLinear()
        )
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r}: expected one of {[*sorted(RECIPES), ADAPTIVE]}")
    return GroupedFp8Linear(recipe)


def fp8_glu_linear_fn(recipe: str) -> Any:
    """The MLP down projection's ``GLULinearFn`` of ``recipe`` (core's
    ``LayerKernels.glu_linear``): ``fp8_glu_linear``, the SwiGLU of the packed fc1 output
    written straight as the FP8 operands, for a recipe whose activation operands are 1x128
    tiles along both dimensions (``blockwise``); None for the others and ``adaptive`` (their
    MLPs run the SwiGLU kernel, then the linear)."""
    if recipe == ADAPTIVE:
        return None
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r}: expected one of {[*sorted(RECIPES), ADAPTIVE]}")
    r = RECIPES[recipe]
    if r.activation != "1x128" or r.wgrad != "1x128":
        return None

    def fn(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:  # fmt: skip
        from longboat.kernels.fp8.glu_linear import fp8_glu_linear

        return fp8_glu_linear(h, weight, bias, recipe=recipe, **kw)

    return fn


def fp8_linear_fn(recipe: str) -> Any:
    """The ``LinearFn`` of ``recipe`` (a name of ``RECIPES`` or ``adaptive``)."""
    if recipe == ADAPTIVE:
        return AdaptiveLinear()
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r}: expected one of {[*sorted(RECIPES), ADAPTIVE]}")

    def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:  # fmt: skip
        return fp8_linear(x, weight, bias, recipe=recipe, **kw)

    return fn


__all__ = [
    "ADAPTIVE",
    "AdaptiveGroupedLinear",
    "AdaptiveLinear",
    "GroupedFp8Linear",
    "fp8_glu_linear_fn",
    "fp8_grouped_linear_fn",
    "fp8_linear_fn",
]
