"""``model.moe_aux_loss``: the load-balancing loss an MoE model trains with.

``hf`` is transformers' term (``load_balancing_loss_func`` of Qwen3-MoE /
Mixtral): the router logits of every MoE layer of the forward are pooled, ``P_e`` is the
mean softmax probability of expert ``e`` and ``f_e`` the mean number of top-k slots that pick
it (so ``sum_e f_e = topk``), both over all layers' tokens together; ``aux = E * sum_e f_e
P_e`` and the objective is ``lm_loss + moe_aux_loss_coeff * aux``. Gradients flow through
``P_e`` only (the top-k selection is a count).

``megatron`` is megatron-core's ``aux_loss`` router type: every layer adds its own
``coeff * E / topk * sum_e f_e P_e`` (another scale, summed over layers instead of pooled).

``auto`` (the default) is ``hf`` where the layout allows it and ``megatron`` elsewhere, said
in one line at the start of the run (``pooled_aux_loss_notice``); an explicit ``hf`` where
it cannot apply is a ``ConfigError``.

Under ``hf`` megatron's term is off and the MoE layers are built with
``pooled_aux_router.PooledAuxRouter``, whose records ``pooled_aux_router.pooled_aux_loss``
combines after the forward. This module holds the config checks only (no torch: the
validator runs it before any heavy import).
"""

from __future__ import annotations

from typing import Any

from longboat.core.config.errors import ConfigError, ConfigProblem

MODES = ("auto", "hf", "megatron")
KEY = "model.moe_aux_loss"


def uses_pooled_aux_loss(cfg: Any) -> bool:
    """True when ``cfg`` (a ``DecoderModelConfig``) asks for the pooled (``hf``) term where it
    applies: an MoE model with a non-zero ``moe_aux_loss_coeff`` and ``moe_aux_loss`` ``auto``
    or ``hf``."""
    mode = getattr(cfg, "moe_aux_loss", "auto")
    return bool(cfg.num_experts) and cfg.moe_aux_loss_coeff > 0 and mode in ("auto", "hf")


def pooled_aux_loss_blockers(
    *,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    sequence_parallel: bool = False,
    full_recompute: bool = False,
) -> list[str]:
    """Why transformers' pooled term cannot be computed under this layout (empty: it can)."""
    blockers = []
    if pipeline_parallel > 1:
        blockers.append(
            f"parallel.pipeline_parallel={pipeline_parallel}: the pooled term needs every "
            "MoE layer's router logits on one rank, and the layers sit on other stages"
        )
    if context_parallel > 1:
        blockers.append(
            f"parallel.context_parallel={context_parallel}: each rank routes a share of the "
            "sequence, so its means would not be HF's"
        )
    if sequence_parallel:
        blockers.append(
            "sequence_parallel: each tensor-parallel rank routes a share of the tokens, so its "
            "means would not be HF's"
        )
    if full_recompute:
        blockers.append(
            "train.recompute=full: the layers' forward runs without autograd "
            "and again in the backward, after the loss is formed"
        )
    return blockers


def pooled_aux_loss_applies(cfg: Any, **layout: Any) -> bool:
    """``cfg`` trains with the pooled term under ``layout`` (``pooled_aux_loss_blockers``'
    keywords)."""
    return uses_pooled_aux_loss(cfg) and not pooled_aux_loss_blockers(**layout)


def pooled_aux_loss_notice(cfg: Any, **layout: Any) -> str | None:
    """The run's one line when ``auto`` falls back to megatron's term (else None)."""
    if getattr(cfg, "moe_aux_loss", "auto") != "auto" or not uses_pooled_aux_loss(cfg):
        return None
    blockers = pooled_aux_loss_blockers(**layout)
    if not blockers:
        return None
    why = blockers[0].split(":")[0]
    return (
        f"model.moe_aux_loss: megatron's per-layer load-balancing loss (transformers' pooled "
        f"term cannot apply with {why})."
    )


def pooled_aux_loss_problems(cfg: Any, **layout: Any) -> list[ConfigProblem]:
    """Why ``cfg``'s ``model.moe_aux_loss`` cannot run under this layout (empty: it can):
    an unknown value, or an explicit ``hf`` that the layout blocks."""
    mode = getattr(cfg, "moe_aux_loss", "auto")
    if mode not in MODES:
        return [
            ConfigProblem(
                key=KEY, value=mode, message=f"must be one of {list(MODES)}.", fix="pick one."
            )
        ]
    if mode != "hf" or not uses_pooled_aux_loss(cfg):
        return []
    blockers = pooled_aux_loss_blockers(**layout)
    fix = f"set {KEY}=auto or {KEY}=megatron (megatron's per-layer load-balancing loss)"
    if layout.get("full_recompute"):
        fix += " or train.recompute=selective"
    return [
        ConfigProblem(key=KEY, value=mode, message=f"'hf' cannot apply with {b}.", fix=fix)
        for b in blockers
    ]


def check_pooled_aux_loss(cfg: Any, **layout: Any) -> None:
    """Raise ``ConfigError`` for ``pooled_aux_loss_problems(cfg, **layout)``."""
    problems = pooled_aux_loss_problems(cfg, **layout)
    if problems:
        raise ConfigError(problems)


__all__ = [
    "KEY",
    "MODES",
    "check_pooled_aux_loss",
    "pooled_aux_loss_applies",
    "pooled_aux_loss_blockers",
    "pooled_aux_loss_notice",
    "pooled_aux_loss_problems",
    "uses_pooled_aux_loss",
]
