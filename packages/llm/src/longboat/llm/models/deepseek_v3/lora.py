"""LoRA on DeepSeek-V3: which linears take adapters, and their PEFT names.

Default ``lora.targets`` (a model group's, when the run names none): every projection of
multi-head latent attention this model has (``linear_q_proj`` without a q latent, else
``linear_q_down_proj`` + ``linear_q_up_proj``; ``linear_kv_down_proj``,
``linear_kv_up_proj``, ``linear_proj``) and the MLPs of the dense layers
(``mlp.linear_fc1`` / ``mlp.linear_fc2``) and of the shared experts
(``shared_experts.linear_fc1`` / ``shared_experts.linear_fc2``). The routed experts keep
their weights and stay grouped. Plain ``linear_fc1`` / ``linear_fc2`` adapt every MLP,
routed experts included, as in Qwen3-MoE: ``model.moe_experts=auto`` then runs megatron's
per-expert loop (adapters need per-expert linears) and ``grouped`` is refused.

DeepSeek-V3.2's sparse attention is megatron's absorbed MLA, which reads
``linear_kv_up_proj``'s weight directly (folded into the queries and the output) instead of
running the module, so an adapter there would never act: that target is refused.

A LoRA run holds the routing bias of aux-loss-free balancing as loaded, like every base
weight: the PEFT adapter on the base then computes what the merged export does.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from longboat.core.config.errors import ConfigProblem

KEY = "lora.targets"
_ATTENTION_OUT = ("linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")
_DENSE = ("mlp.linear_fc1", "mlp.linear_fc2")
_SHARED = ("shared_experts.linear_fc1", "shared_experts.linear_fc2")
_EVERY_MLP = ("linear_fc1", "linear_fc2")
_MTP = ("eh_proj",)


def _attention(cfg: Any) -> tuple[str, ...]:
    q = (
        ("linear_q_proj",)
        if cfg.q_lora_rank is None
        else ("linear_q_down_proj", "linear_q_up_proj")
    )
    out = _ATTENTION_OUT
    if cfg.index_topk is not None:  # absorbed attention: the kv up weight is read, not run
        out = tuple(t for t in out if t != "linear_kv_up_proj")
    return q + out


def default_targets(cfg: Any) -> list[str]:
    """The linears LoRA adapts in a model ``cfg`` (a ``DeepseekV3Config``) by default."""
    mlp = (_DENSE if cfg.first_k_dense else ()) + (_SHARED if cfg.num_shared_experts else ())
    return [*_attention(cfg), *mlp]


def target_problems(cfg: Any, targets: list[str]) -> list[ConfigProblem]:
    """Why ``targets`` cannot be the ``lora.targets`` of model ``cfg``: a name that is no
    linear of it, or ``linear_kv_up_proj`` under sparse attention."""
    have = set(_attention(cfg)) | set(_EVERY_MLP)
    have |= set(_DENSE if cfg.first_k_dense else ()) | set(
        _SHARED if cfg.num_shared_experts else ()
    )
    have |= set(_MTP if cfg.mtp_num_layers else ())
    problems = []
    if cfg.index_topk is not None and "linear_kv_up_proj" in targets:
        problems.append(
            ConfigProblem(
                key=KEY,
                value=list(targets),
                message="DeepSeek-V3.2's sparse attention (model.index_topk) reads "
                "linear_kv_up_proj's weight directly (absorbed into the queries and the "
                "output), so an adapter on it would never run",
                fix="drop linear_kv_up_proj from lora.targets",
            )
        )
    unknown = [t for t in targets if t not in have and t != "linear_kv_up_proj"]
    if unknown:
        problems.append(
            ConfigProblem(
                key=KEY,
                value=list(targets),
                message=f"{unknown} name no linear of this DeepSeek-V3 model",
                fix=f"choose from {sorted(have)} (default: {default_targets(cfg)})",
            )
        )
    return problems


def frozen_base(cfg: Any) -> tuple[Any, str | None]:
    """``cfg`` for a LoRA run: the routing bias of aux-loss-free balancing stays as loaded
    (its update would change the frozen base, which a PEFT adapter does not carry), with the
    run's line saying so; unchanged (None) when it does not move anyway."""
    if not cfg.num_experts or not cfg.moe_router_bias_update_rate:
        return cfg, None
    notice = (
        "LoRA: the experts' routing bias stays as loaded (model.moe_router_bias_update_rate "
        f"{cfg.moe_router_bias_update_rate:g} -> 0: the base is frozen)."
    )
    return dataclasses.replace(cfg, moe_router_bias_update_rate=0.0), notice


_KINDS = {"rows": "column", "cols": "row"}  # this family's split names -> core's


def peft_slot(
    name: str, cfg: Any, *, global_layer: int | None, ep: Any, prefix: str = "model."
) -> Any:
    """The ``hf_mapping.Slot`` (core's kinds) of megatron tensor ``name``: where its adapter
    goes in a PEFT adapter of ``DeepseekV3ForCausalLM`` (``core.megatron.peft.SlotFn``)."""
    from longboat.core.megatron.hf_mapping import Slot
    from longboat.llm.models.deepseek_v3.hf_weights import PREFIX, megatron_to_hf_slot

    if prefix != PREFIX:
        raise ValueError(f"DeepSeek-V3's decoder sits under {PREFIX!r}, not {prefix!r}")
    slot = megatron_to_hf_slot(name, cfg, global_layer=global_layer, ep=ep)
    if slot.kind.startswith("expert"):
        raise PeftExportUnsupported(_NO_PEFT)
    return Slot(_KINDS.get(slot.kind, slot.kind), slot.hf_names)


_MLP_MODULE = re.compile(r"\.mlp\.((?:shared_experts\.)?(?:gate|up|down)_proj)$")


def peft_parameter(hf_module: str) -> str | None:
    """The PEFT ``target_parameters`` entry of a dense or shared-expert MLP projection
    (``model.layers.0.mlp.gate_proj`` -> ``mlp.gate_proj.weight``); None for the others.

    PEFT's transformers-5 mapping turns a ``target_modules`` name ``gate_proj`` / ``up_proj``
    / ``down_proj`` of a DeepSeek-V3 model into its fused routed experts, so these linears
    are named by their weight, which PEFT adapts the same way (``B @ A`` added)."""
    m = _MLP_MODULE.search(hf_module)
    return None if m is None else f"mlp.{m.group(1)}.weight".replace("mlp.shared_", "shared_")


_NO_PEFT = (
    "the routed experts' adapters (lora.targets linear_fc1 / linear_fc2) have no PEFT form on "
    "transformers' DeepseekV3ForCausalLM, which holds the experts as fused tensors; the merged "
    "HF export carries them"
)


def peft_export_problem(cfg: Any, targets: list[str]) -> str | None:
    """Why a PEFT adapter export of a run adapting ``targets`` cannot be written (None: it
    can): adapters on the routed experts."""
    return _NO_PEFT if cfg.num_experts and set(targets) & set(_EVERY_MLP) else None


class PeftExportUnsupported(ValueError):
    """Adapters a PEFT adapter of transformers' model cannot carry (the routed experts)."""


class DeepseekV3LoRATargets:
    """The family's ``LLMFamily.lora_targets``."""

    default = staticmethod(default_targets)
    problems = staticmethod(target_problems)
    peft_slot = staticmethod(peft_slot)
    peft_parameter = staticmethod(peft_parameter)
    peft_export_problem = staticmethod(peft_export_problem)
    frozen_base = staticmethod(frozen_base)


LORA_TARGETS = DeepseekV3LoRATargets()

__all__ = [
    "LORA_TARGETS",
    "PeftExportUnsupported",
    "default_targets",
    "frozen_base",
    "peft_export_problem",
    "peft_parameter",
    "peft_slot",
    "target_problems",
]
