"""``train.memory_budget``: the device memory a run may plan for. Import-free (config
validation checks the value before torch is imported).

``auto`` (the default): ``AUTO_FRACTION`` of the accelerator's free memory when the run
starts, or no budget where the accelerator reports none (the host CPU); a number: that many
GB (2^30 bytes, as the accelerator's memory stats count them), on any device.
"""

from __future__ import annotations

from typing import Any

MEMORY_BUDGET_AUTO = "auto"
"""``train.memory_budget`` default: plan for ``AUTO_FRACTION`` of the free device memory."""

AUTO_FRACTION = 0.9
"""Share of the device's free memory ``auto`` plans for (the rest absorbs the allocator's
fragmentation and the library workspaces the estimate does not see)."""

GB = float(1 << 30)
"""Bytes in one GB as the plan and the accelerator's memory stats count them (GiB)."""


def parse_memory_budget(value: Any) -> float | None:
    """GB of a ``train.memory_budget`` value: None for ``auto``, the number for a positive
    number (or its string, as the composed config stores it); ValueError otherwise."""
    if isinstance(value, str) and value.strip().lower() == MEMORY_BUDGET_AUTO:
        return None
    if isinstance(value, bool):
        raise ValueError(value)
    try:
        gb = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(value) from exc
    if not gb > 0 or gb == float("inf"):
        raise ValueError(value)
    return gb


def memory_budget_problem(value: Any) -> str | None:
    """Why ``value`` is not a valid ``train.memory_budget`` (None: it is)."""
    try:
        parse_memory_budget(value)
    except ValueError:
        return "must be auto or a positive number of GB"
    return None


def check_memory_budget(train: Any, problems: Any) -> None:
    """Add a problem to ``problems`` (a ``ProblemCollector``) when ``train.memory_budget`` of
    ``train`` (a composed node or the typed train config) is not ``auto`` or a number."""
    value = (
        train.get("memory_budget")
        if hasattr(train, "get")
        else getattr(train, "memory_budget", None)
    )
    if value is None:
        return
    why = memory_budget_problem(value)
    if why:
        problems.add(
            "train.memory_budget",
            why,
            value=value,
            fix="set train.memory_budget=auto (90% of the free device memory) or a number of "
            "GB, e.g. train.memory_budget=70",
        )


def resolve_budget_bytes(value: Any, accelerator: Any) -> tuple[float | None, str]:
    """Bytes the run plans for and one phrase saying where they come from; (None, why) where
    there is nothing to plan for (``auto`` on an accelerator that reports no device memory).
    ``accelerator``: core's ``Accelerator`` (its ``memory_capacity()``)."""
    gb = parse_memory_budget(value)
    if gb is not None:
        return gb * GB, f"train.memory_budget={gb:g} GB"
    capacity = accelerator.memory_capacity()
    if capacity is None:
        return None, f"the {accelerator.device_type} device reports no memory to plan for"
    free, total = capacity
    return (
        AUTO_FRACTION * free,
        f"auto: {AUTO_FRACTION:.0%} of {free / GB:.1f} GB free of {total / GB:.1f} GB",
    )


def format_bytes(n: float) -> str:
    """``n`` bytes as GB with one decimal, or MB / KB below 0.1 GB (tiny runs)."""
    if n >= 0.1 * GB:
        return f"{n / GB:.1f} GB"
    if n >= 0.1 * (1 << 20):
        return f"{n / (1 << 20):.1f} MB"
    return f"{n / 1024:.1f} KB"
