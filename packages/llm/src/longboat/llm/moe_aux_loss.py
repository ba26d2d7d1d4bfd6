"""``model.moe_aux_loss``: the load-balancing loss an MoE model trains with.

``hf`` (the default) is transformers' term (``load_balancing_loss_func`` of Qwen3-MoE /
Mixtral): the router logits of every MoE layer of the forward are pooled, ``P_e`` is the
mean softmax probability of expert ``e`` and ``f_e`` the mean number of top-k slots that pick
it (so ``sum_e f_e = topk``), both over all layers' tokens together; ``aux = E * sum_e f_e
P_e`` and the objective is ``lm_loss + moe_aux_loss_coeff * aux``. Gradients flow through
``P_e`` only (the top-k selection is a count).

``megatron`` is megatron-core's ``aux_loss`` router type: every layer adds its own
``coeff * E / topk * sum_e f_e P_e`` (another scale, summed over layers instead of pooled).

Under ``hf`` megatron's term is off and the MoE layers are built with
``pooled_aux_router.PooledAuxRouter``, whose records ``pooled_aux_router.pooled_aux_loss``
combines after the forward. This module holds the config checks only (no torch: the
validator runs it before any heavy import).
"""

from __future__ import annotations

from typing import Any

from longboat.core.config.errors import ConfigError, ConfigProblem

MODES = ("hf", "megatron")
KEY = "model.moe_aux_loss"


def uses_pooled_aux_loss(cfg: Any) -> bool:
    """True when ``cfg`` (a ``DecoderModelConfig``) trains with the pooled (``hf``) term:
    an MoE model with a non-zero ``moe_aux_loss_coeff`` and ``moe_aux_loss=hf``."""
    return bool(cfg.num_experts) and cfg.moe_aux_loss_coeff > 0 and cfg.moe_aux_loss == "hf"


def pooled_aux_loss_problems(
    cfg: Any,
    *,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    sequence_parallel: bool = False,
    full_recompute: bool = False,
) -> list[ConfigProblem]:
    """Why ``cfg``'s ``model.moe_aux_loss`` cannot run under this layout (empty: it can)."""
    mode = getattr(cfg, "moe_aux_loss", "hf")
    if mode not in MODES:
        return [
            ConfigProblem(
                key=KEY, value=mode, message=f"must be one of {list(MODES)}.", fix="pick one."
            )
        ]
    if not uses_pooled_aux_loss(cfg):
        return []
    fix = f"set {KEY}=megatron (megatron's per-layer load-balancing loss)"
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
            "train.activation_checkpointing=full: the layers' forward runs without autograd "
            "and again in the backward, after the loss is formed"
        )
        fix += " or train.activation_checkpointing=selective"
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
    "pooled_aux_loss_problems",
    "uses_pooled_aux_loss",
]
