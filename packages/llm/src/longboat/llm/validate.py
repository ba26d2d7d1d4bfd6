"""llm-specific config checks run by core's validator before any heavy init."""

from __future__ import annotations

from typing import Any

from longboat.core.config.errors import ConfigError

FAMILIES = ("llama3", "qwen3", "qwen3_moe")


def validate_llm(cfg: Any, world_size: int | None, problems: Any) -> None:
    """Model shape vs parallel sizes (TP divides heads, PP divides layers, EP divides experts)."""
    model = cfg.get("model") if hasattr(cfg, "get") else None
    if model is None or model.get("name") not in FAMILIES:
        return
    from longboat.llm.config import LLMModelConfig

    try:
        arch = LLMModelConfig.from_mapping(model).to_arch()
        arch.validate()
        par = cfg.get("parallel") or {}
        arch.validate_parallel(
            tp=int(par.get("tensor_parallel", 1)),
            pp=int(par.get("pipeline_parallel", 1)),
            ep=int(par.get("expert_parallel", 1)),
            vpp=par.get("virtual_pipeline_parallel"),
        )
    except ConfigError as exc:
        for problem in exc.problems:
            # core's generic validator already checks TP vs heads and PP vs layers.
            if not any(k in problem.message for k in ("num_attention_heads", "num_layers")):
                problems.add(problem.key, problem.message, value=problem.value, fix=problem.fix)
