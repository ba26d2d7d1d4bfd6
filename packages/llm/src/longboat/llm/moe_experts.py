"""``model.moe_experts``: how an MoE model's routed experts run (config checks, no torch).

``grouped`` (core's ``grouped_experts.GroupedExperts``: two grouped GEMMs a layer over
stacked weights, no host sync with one expert-parallel rank) is what ``auto`` picks, except
where LoRA adapts the experts' ``linear_fc1`` / ``linear_fc2``: adapters go on per-expert
linears, so such a run gets megatron's ``SequentialMLP`` and says so in one line. An explicit
``grouped`` with LoRA on those linears is a ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from longboat.core.config.errors import ConfigError, ConfigProblem

MODES = ("auto", "grouped", "sequential")
KEY = "model.moe_experts"
EXPERT_LINEARS = ("linear_fc1", "linear_fc2")


def lora_targets(lora: Any) -> list[str]:
    """The linears ``lora`` (a LoRA config or None) adapts; none when it is off."""
    if lora is None or not getattr(lora, "enabled", True):
        return []
    return list(getattr(lora, "targets", ()))


def _on_experts(cfg: Any, targets: list[str]) -> list[str]:
    """The LoRA ``targets`` that are expert linears of MoE model ``cfg`` (empty: none)."""
    return [t for t in targets if t in EXPERT_LINEARS] if cfg.num_experts else []


def moe_experts_problems(cfg: Any, targets: list[str]) -> list[ConfigProblem]:
    """Why ``cfg.moe_experts`` cannot run with LoRA on ``targets`` (``lora_targets``)."""
    mode = getattr(cfg, "moe_experts", "auto")
    if mode not in MODES:
        return [ConfigProblem(key=KEY, value=mode, message=f"must be one of {list(MODES)}.",
                              fix="pick one.")]  # fmt: skip
    on_experts = _on_experts(cfg, targets)
    if mode == "grouped" and on_experts:
        return [
            ConfigProblem(
                key=KEY,
                value=mode,
                message=f"LoRA adapts the experts' {on_experts}, which grouped experts hold "
                "as stacked weights, not per-expert linears.",
                fix=f"set {KEY}=sequential (or auto), or drop {on_experts} from lora.targets",
            )
        ]
    return []


def moe_experts_for_run(cfg: Any, lora: Any = None) -> tuple[Any, str | None]:
    """``cfg`` with ``moe_experts`` resolved for a run with ``lora``, and the run's one line
    when ``auto`` picks megatron's per-expert loop (else None). ``ConfigError`` for
    ``moe_experts_problems``."""
    targets = lora_targets(lora)
    problems = moe_experts_problems(cfg, targets)
    if problems:
        raise ConfigError(problems)
    on_experts = _on_experts(cfg, targets)
    if getattr(cfg, "moe_experts", "auto") != "auto" or not on_experts:
        return cfg, None
    notice = (
        f"{KEY}: megatron's per-expert loop (LoRA adapts the experts' {on_experts}, which "
        "need per-expert linears)."
    )
    return dataclasses.replace(cfg, moe_experts="sequential"), notice


__all__ = ["KEY", "MODES", "lora_targets", "moe_experts_for_run", "moe_experts_problems"]
