"""``optim.moment_dtype`` on the megatron engine: where AdamW's moments may be kept in bf16.

The megatron engine stores the moments in bf16 only through the one-pass update
(``engine.one_pass_adamw``): its kernel (``longboat.kernels.adamw_master_step_``) reads bf16
moments to fp32, updates them in fp32 and stores them rounded to nearest even, 2 bytes a
moment element instead of 4. Megatron's own step (torch's AdamW) would update bf16 moments
in bf16 arithmetic (or refuse them), so a run whose steps go through it keeps fp32 moments:
``bf16_moments_blocker`` says which runs those are, ``moment_dtype_problems`` refuses
``optim.moment_dtype=bf16`` for them before any work, and the memory plan
(``moment_plan_fields``) chooses bf16 moments, with ``optim.moment_dtype`` null, only where
it says none and nothing else fits. bf16 moments change numerics (the moments lose 16 mantissa
bits at every step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the validators run while a config composes, without torch
    import torch


def bf16_moments_blocker(
    *,
    optimizer: str,
    one_pass_adamw: bool,
    precision: str,
    grad_clip: float,
    expert_parallel: int = 1,
) -> str | None:
    """None where every step of a megatron run goes through the one-pass update (which keeps
    bf16 moments), else why not: ``optimizer`` (``optim.name``), ``one_pass_adamw``
    (``optim.one_pass_adamw``), ``precision`` (``train.precision``), ``grad_clip``
    (``optim.grad_clip``), ``expert_parallel`` (``parallel.expert_parallel``)."""
    if optimizer != "adamw":
        return f"optim.name={optimizer} keeps no AdamW moments"
    if not one_pass_adamw:
        return "optim.one_pass_adamw=false steps through megatron's torch AdamW (fp32 moments)"
    if precision == "fp16":
        return "train.precision=fp16: loss-scaled steps go through megatron's torch AdamW"
    if expert_parallel > 1 and grad_clip > 0:
        return (
            "clipping over expert-parallel optimizer parts (parallel.expert_parallel > 1 with "
            "optim.grad_clip > 0) goes through megatron's torch AdamW"
        )
    return None


def config_blocker(cfg: Any) -> str | None:
    """``bf16_moments_blocker`` of a run's config (a composed node or a typed config)."""

    def get(key: str, default: Any) -> Any:
        node = cfg
        for part in key.split("."):
            node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
            if node is None:
                return default
        return node

    return bf16_moments_blocker(
        optimizer=str(get("optim.name", "adamw")),
        one_pass_adamw=bool(get("optim.one_pass_adamw", True)),
        precision=str(get("train.precision", "bf16")),
        grad_clip=float(get("optim.grad_clip", 0.0)),
        expert_parallel=int(get("parallel.expert_parallel", 1)),
    )


def moment_dtype_problems(cfg: Any, world_size: int | None, problems: Any) -> None:
    """A megatron stack's validator: ``optim.moment_dtype=bf16`` refused where a step would
    go through megatron's torch AdamW (``bf16_moments_blocker``)."""
    optim = cfg.get("optim") if hasattr(cfg, "get") else getattr(cfg, "optim", None)
    moments = None if optim is None else optim.get("moment_dtype")
    if moments != "bf16":
        return
    why = config_blocker(cfg)
    if why is not None:
        problems.add(
            "optim.moment_dtype",
            f"bf16 moments are kept by the one-pass AdamW update only, and {why}",
            value=moments,
            fix="set optim.moment_dtype=fp32 (or null), or run where the one-pass update "
            "takes every step (optim.one_pass_adamw=true, optim.name=adamw, bf16 or fp32 "
            "precision, no clipping across expert-parallel parts)",
        )


def moment_plan_fields(cfg: Any) -> dict[str, Any]:
    """``memory_plan.OptimizerPlan``'s moment fields for a run's config: the moments'
    bytes as set, whether ``optim.moment_dtype`` is pinned, and whether the plan may choose
    bf16 moments (null and ``config_blocker`` finds nothing)."""
    moments = cfg.optim.moment_dtype
    return {
        "moment_bytes": 2 if moments == "bf16" else 4,
        "moments_pinned": moments is not None,
        "allow_bf16_moments": moments is None and config_blocker(cfg) is None,
    }


def moment_torch_dtype(moment_dtype: str | None) -> torch.dtype:
    """The torch dtype of ``optim.moment_dtype`` (null: fp32)."""
    from longboat.core.engine.torch.master_weights import MOMENT_DTYPES

    return MOMENT_DTYPES[moment_dtype or "fp32"]


__all__ = [
    "bf16_moments_blocker",
    "config_blocker",
    "moment_dtype_problems",
    "moment_plan_fields",
    "moment_torch_dtype",
]
