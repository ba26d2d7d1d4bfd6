"""What a stack honours of core's ``train.*``, ``export.*`` and ``ema.*`` keys.

Every stack reads the same core keys, but not every stack can act on every value: a stack
without a compiled path cannot honour ``train.compile=true``, one whose recompute is per
layer has no components to pick. A stack declares what it offers in
``Stack.capabilities`` (a ``Capabilities``); ``capability_problems`` refuses, before any
work, every key set to a value the run's stack would not act on, naming the key and what
the stack offers instead. Keys core's trainer itself carries out for every stack (steps,
batch sizes, seed, logging, the NaN guard) need no declaration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from longboat.core.config.errors import ProblemCollector
from longboat.core.config.schema import (
    BASE_PRECISIONS,
    EXPORT_FORMAT_AUTO,
    PRECISIONS,
    RECOMPUTE_MODES,
)


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """The values of core's ``train.*`` / ``export.*`` keys a stack acts on; any other
    value is refused at compose time (``capability_problems``)."""

    recompute: tuple[str, ...] = ("none",)
    """``train.recompute`` modes the stack implements (``none`` always)."""
    recompute_layers: bool = False
    """Whether ``train.recompute_layers`` (only the first n layers) is honoured."""
    recompute_components: tuple[str, ...] = ()
    """Names ``train.recompute_components`` may list (empty: the key is not offered)."""
    compile: bool = False
    """Whether ``train.compile=true`` compiles anything."""
    precisions: tuple[str, ...] = BASE_PRECISIONS
    """``train.precision`` values the stack trains in (``fp8`` only where declared)."""
    eval: bool = True
    """Whether the stack evaluates (``train.eval_every > 0``)."""
    profiler: bool = True
    """Whether ``train.profiler.*`` traces the stack's steps (core's trainer runs it)."""
    export: bool = True
    """Whether the stack writes an export (``export.enabled`` / ``export.dir``)."""
    export_formats: tuple[str, ...] | Callable[[], Sequence[str]] = (EXPORT_FORMAT_AUTO,)
    """``export.format`` values the stack writes, or a function returning them when they
    depend on what is installed (a stack whose families bring their own formats)."""
    export_adapter: bool = False
    """Whether ``export.adapter_dir`` (LoRA adapters as a PEFT adapter) is written."""
    memory_plan: bool = False
    """Whether the stack plans its memory to ``train.memory_budget`` (without a plan, only
    ``auto`` is accepted)."""
    bf16_moments: bool = False
    """Whether ``optim.moment_dtype=bf16`` (AdamW moments stored in bf16) is kept (the torch
    engine's master-weight AdamW, the megatron engine's one-pass AdamW update); without it
    only fp32 (or null) is accepted."""
    ema: bool = False
    """Whether ``ema.enabled=true`` keeps (``longboat.core.train.ema``), checkpoints and, with
    ``ema.export``, exports an average of the weights."""


def _get(node: Any, key: str) -> Any:
    for part in key.split("."):
        if node is None:
            return None
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return node


def fp8_problems(cfg: Any, problems: ProblemCollector, *, compiled: bool = True) -> None:
    """What a ``train.precision=fp8`` run cannot honour in any stack: its FP8 GEMMs run eagerly
    (no ``train.compile``) on the linears of longboat's layer spec (no ``model.layer_backend``
    of Transformer Engine or megatron's local modules). ``compiled``: whether the stack has a
    compiled path at all (where not, ``train.compile`` is refused as such already)."""
    if compiled and _get(cfg, "train.compile"):
        problems.add(
            "train.compile",
            "is not traced through the FP8 linears (train.precision=fp8)",
            value=True,
            fix="use train.compile=false with train.precision=fp8, or another precision",
        )
    backend = _get(cfg, "model.layer_backend")
    if backend in ("te", "local"):
        problems.add(
            "model.layer_backend",
            "has no FP8 linears of longboat's (train.precision=fp8 runs on the longboat spec)",
            value=backend,
            fix="use model.layer_backend=longboat (or auto without Transformer Engine)",
        )


def capability_problems(
    cfg: Any, caps: Capabilities, stack: str, problems: ProblemCollector
) -> None:
    """Add a problem for every ``train.*`` / ``export.*`` key of ``cfg`` (a composed node or
    an ``ExperimentConfig``) set to a value stack ``stack`` does not act on."""
    who = f"the {stack} stack"

    def refuse(key: str, value: Any, what: str, offers: str) -> None:
        problems.add(key, f"{who} {what}", value=value, fix=f"{who} offers {offers}")

    mode = _get(cfg, "train.recompute")
    if mode in RECOMPUTE_MODES and mode not in caps.recompute:  # others: core's choice check
        refuse("train.recompute", mode, "does not implement this mode",
               "train.recompute=" + " | ".join(caps.recompute))  # fmt: skip
    layers = _get(cfg, "train.recompute_layers")
    if layers is not None:
        if not caps.recompute_layers:
            refuse("train.recompute_layers", layers, "cannot recompute only the first n layers",
                   "no train.recompute_layers (leave it null)")  # fmt: skip
        elif isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            problems.add("train.recompute_layers", "must be >= 1 or null (every layer)",
                         value=layers, fix="set a number of layers, or null")  # fmt: skip
    parts = _get(cfg, "train.recompute_components")
    if parts is not None:
        parts = list(parts)
        unknown = sorted(set(parts) - set(caps.recompute_components))
        if not caps.recompute_components:
            refuse("train.recompute_components", parts, "has no components to choose from",
                   "no train.recompute_components (leave it null)")  # fmt: skip
        elif unknown or not parts:
            problems.add("train.recompute_components",
                         f"unknown component(s) {unknown}" if unknown else "is empty",
                         value=parts, fix="list some of " + ", ".join(caps.recompute_components)
                         + " (null: all)")  # fmt: skip
    if _get(cfg, "train.compile") and not caps.compile:
        refuse("train.compile", True, "has no compiled path", "train.compile=false only")
    precision = _get(cfg, "train.precision")
    if precision in PRECISIONS and precision not in caps.precisions:
        refuse("train.precision", precision, "does not train in this precision",
               "train.precision=" + " | ".join(caps.precisions))  # fmt: skip
    if precision == "fp8" and "fp8" in caps.precisions:
        fp8_problems(cfg, problems, compiled=caps.compile)
    if "fp8" not in caps.precisions:  # the train.fp8.* settings mean nothing there
        recipe = _get(cfg, "train.fp8.recipe")
        if recipe is not None and recipe != "blockwise":
            refuse("train.fp8.recipe", recipe, "has no FP8 training",
                   "no train.fp8.* (leave the defaults)")  # fmt: skip
        if _get(cfg, "train.fp8.allow_recipe_change"):
            refuse("train.fp8.allow_recipe_change", True, "has no FP8 training",
                   "no train.fp8.* (leave the defaults)")  # fmt: skip
    every = _get(cfg, "train.eval_every")
    if isinstance(every, int) and every > 0 and not caps.eval:
        refuse("train.eval_every", every, "has no evaluation", "train.eval_every=0 only")
    if _get(cfg, "train.profiler.enabled") and not caps.profiler:
        refuse("train.profiler.enabled", True, "cannot be profiled", "no profiler")
    enabled = _get(cfg, "export.enabled")
    if enabled and not caps.export:
        refuse("export.enabled", True, "writes no export", "export.enabled=false only")
    fmt = _get(cfg, "export.format")
    formats = caps.export_formats
    formats = tuple(formats() if callable(formats) else formats)
    if fmt is not None and fmt not in formats:
        refuse("export.format", fmt, "does not write this format",
               "export.format=" + " | ".join(formats))  # fmt: skip
    budget = _get(cfg, "train.memory_budget")
    if budget is not None and str(budget).strip().lower() != "auto" and not caps.memory_plan:
        refuse("train.memory_budget", budget, "does not plan its memory yet",
               "train.memory_budget=auto only")  # fmt: skip
    moments = _get(cfg, "optim.moment_dtype")
    if moments not in (None, "fp32") and not caps.bf16_moments:
        refuse("optim.moment_dtype", moments, "keeps fp32 optimizer moments",
               "optim.moment_dtype=fp32 only")  # fmt: skip
    if _get(cfg, "ema.enabled") and not caps.ema:
        refuse("ema.enabled", True, "keeps no average of the weights", "ema.enabled=false only")
    adapter = _get(cfg, "export.adapter_dir")
    if adapter is not None and not caps.export_adapter:
        refuse("export.adapter_dir", adapter, "writes no separate adapter",
               "no export.adapter_dir (leave it null)")  # fmt: skip


__all__ = ["Capabilities", "capability_problems", "fp8_problems"]
