"""The ``LinearFn`` a decoder layer's linears run on for ``train.precision=fp8``.

``fp8_linear_fn(recipe)`` returns ``fn(x, weight, bias, *, wgrad_hook=None, wgrad_dtype=None)``
(core's ``LayerKernels.linear`` contract): ``fp8_linear`` with the recipe, or for
``adaptive`` the choice of an ``AdaptiveChooser`` per ``(tokens, out, in)`` shape: FP8 in the
fastest recipe where it beats bf16 on this GPU by the chooser's margin, bf16 elsewhere. Each
shape is decided on its first call (measured, or read from the per-GPU timing cache) and
logged once with its timings.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from longboat.kernels.fp8.adaptive import HIGH_PRECISION, AdaptiveChooser, TimingCache
from longboat.kernels.fp8.linear import RECIPES, fp8_linear, high_precision_linear

LOG = logging.getLogger("longboat.kernels.fp8")
ADAPTIVE = "adaptive"


def _adaptive_fn() -> Any:
    choosers: dict[torch.device, AdaptiveChooser] = {}

    def chooser_for(device: torch.device) -> AdaptiveChooser:
        if device not in choosers:
            from longboat.core.device import get_accelerator
            from longboat.kernels.fp8.adaptive import measure_linear

            gpu = get_accelerator().device_name() if device.type != "cpu" else "cpu"

            def measure(shape: tuple[int, int, int], names: tuple[str, ...]) -> dict[str, float]:
                return measure_linear(shape, names, device=device)

            choosers[device] = AdaptiveChooser(gpu, cache=TimingCache.load(), measure=measure)
        return choosers[device]

    def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:  # fmt: skip
        chooser = chooser_for(x.device)
        shape = (x.numel() // x.shape[-1], weight.shape[0], weight.shape[1])
        known = shape in chooser.decisions
        picked = chooser.choice(shape)
        if not known:
            LOG.info("fp8 adaptive on %s:\n%s", chooser.gpu, chooser.table())
        if picked == HIGH_PRECISION:
            return high_precision_linear(x, weight, bias, **kw)
        return fp8_linear(x, weight, bias, recipe=picked, **kw)

    return fn


def fp8_linear_fn(recipe: str) -> Any:
    """The ``LinearFn`` of ``recipe`` (a name of ``RECIPES`` or ``adaptive``)."""
    if recipe == ADAPTIVE:
        return _adaptive_fn()
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r}: expected one of {[*sorted(RECIPES), ADAPTIVE]}")

    def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:  # fmt: skip
        return fp8_linear(x, weight, bias, recipe=recipe, **kw)

    return fn


__all__ = ["ADAPTIVE", "fp8_linear_fn"]
