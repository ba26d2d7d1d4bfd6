"""The embodied run's memory plan (core's ``longboat.core.engine.memory``), made before the
policy is built.

The policy is built a second time on the ``meta`` device (no memory, no compute): its
parameters give the exact state bytes of the run's optimizer layout (master weights and
their storage, AdamW's two fp32 moments, ZeRO-1 / FSDP sharding), and a forward of its
loss on one and two of the run's own samples (collated at the longest prompt, as the
CUDA-graphed step pads them) gives each block's saved activations at the run's shapes, with
the ops dispatched as on the device (``longboat.kernels.meta_stands_for``). Core's chooser
then picks ``train.recompute`` (left null) and the micro-batch split for
``train.memory_budget``, and only where neither fits, with master weights, the storage:
``optim.moment_dtype=bf16`` then ``train.master_weight_storage=bf16_sr`` (each left null;
both change numerics).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import torch

from longboat.core.data.batch_plan import BatchLayout
from longboat.core.engine.memory.activations import profile_activations
from longboat.core.engine.memory.budget import resolve_budget_bytes
from longboat.core.engine.memory.plan import MemoryPlan, Pins, choose_plan
from longboat.core.engine.memory.states import OptimizerLayout, state_bytes
from longboat.core.engine.torch.blocks import find_blocks
from longboat.core.engine.torch.master_weights import ALIGN, CHUNK
from longboat.embodied.models import apply_freezing, build_model
from longboat.embodied.train import lora
from longboat.kernels import meta_stands_for

RECOMPUTE_MODES = ("none", "selective", "full")
"""The embodied stack's ``train.recompute`` modes, least recompute first (selective: every
second block)."""

SHARDED_STATE = {"zero1": "state", "fsdp": "all", "hsdp": "all"}
"""What each ``parallel.strategy`` shards over the data-parallel ranks."""

DEFAULT_MASTER_STORAGE = "split"
"""``train.master_weight_storage`` where it is null and the plan chooses no storage change."""
DEFAULT_MOMENT_DTYPE = "fp32"
"""``optim.moment_dtype`` where it is null and the plan chooses no storage change."""
MOMENT_BYTES = {"fp32": 4, "bf16": 2}


def resolve_storage(cfg: Any, plan: MemoryPlan | None) -> None:
    """Write the storage keys back into ``cfg``: the plan's choice, else the defaults for
    the keys left null."""
    t, o = cfg.train, cfg.optim
    if plan is not None:
        if plan.choice.master_storage is not None:
            t.master_weight_storage = plan.choice.master_storage
        o.moment_dtype = "bf16" if plan.choice.moment_bytes == 2 else "fp32"
    t.master_weight_storage = t.master_weight_storage or DEFAULT_MASTER_STORAGE
    o.moment_dtype = o.moment_dtype or DEFAULT_MOMENT_DTYPE


def no_plan_line(why: str, *, hint: str = "set train.memory_budget=<GB> to plan") -> str:
    """The plan's line where nothing was planned or chosen, and why."""
    return f"Memory plan: none ({why}; {hint}); train.recompute null runs as none."


def optimizer_layout(
    cfg: Any, *, master_weights: bool, strategy: str, dp_size: int, device_type: str
) -> OptimizerLayout:
    """The state layout the run's optimizer will allocate."""
    t = cfg.train
    shards = SHARDED_STATE.get(strategy)
    slices = t.master_weight_update == "slices" or device_type != "cuda"
    return OptimizerLayout(
        master_weights=master_weights,
        master_storage=(t.master_weight_storage or DEFAULT_MASTER_STORAGE)
        if master_weights
        else "fp32",
        moments=2 if cfg.optim.name == "adamw" else 1,
        moment_bytes=MOMENT_BYTES[cfg.optim.moment_dtype or DEFAULT_MOMENT_DTYPE],
        align=ALIGN if master_weights else 1,
        scratch_elements=CHUNK if master_weights and slices else 0,
        state_shards=dp_size if shards else 1,
        param_shards=dp_size if shards == "all" else 1,
    )


def probe_policy(cfg: Any, model_cfg: Any, *, master_weights: bool) -> torch.nn.Module:
    """The run's policy on ``meta``: frozen as configured, LoRA applied, trainable weights
    in the dtype the run trains them in (bf16 with master weights)."""
    with torch.device("meta"):
        model = build_model(cfg.model.name, model_cfg)
    apply_freezing(model, model_cfg)
    if cfg.lora.enabled:
        with torch.device("meta"):
            lora.apply_run_lora(model, cfg)
    if master_weights:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return model


def smallest_over_ranks(budget: float, accelerator: Any) -> float:
    """The smallest budget of all ranks (every rank must choose the same micro-batch split:
    an ``auto`` budget follows each device's free memory)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return budget
    value = torch.tensor([budget], dtype=torch.float64, device=accelerator.device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return float(value.item())


def plan_run_memory(
    cfg: Any,
    model_cfg: Any,
    data: Any,
    layout: BatchLayout,
    accelerator: Any,
    *,
    master_weights: bool,
    strategy: str,
) -> MemoryPlan | str:
    """The run's ``MemoryPlan`` (module doc); the no-plan line (a str) where
    ``train.memory_budget`` is auto and the device reports no memory, or where the policy's
    forward cannot run on ``meta`` (warned). ``data``: the run's ``RunData``. Raises
    ``ConfigError`` when the pinned levers cannot fit."""
    t = cfg.train
    budget, source = resolve_budget_bytes(t.memory_budget, accelerator)
    if budget is None:
        return no_plan_line(source)
    budget = smallest_over_ranks(budget, accelerator)
    model = probe_policy(cfg, model_cfg, master_weights=master_weights)
    opt_layout = optimizer_layout(cfg, master_weights=master_weights, strategy=strategy,
                                  dp_size=layout.dp_size, device_type=accelerator.device_type)  # fmt: skip
    states = state_bytes(model.parameters(), opt_layout)
    if cfg.ema.enabled:  # an fp32 average of what the policy computes with
        states = dataclasses.replace(states, extra=4 * states.trainable_params)
    collate = copy.copy(data.collate)
    collate.fixed_text_length = True  # the longest prompt: what a graphed step pads to

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        samples = [data.dataset[i % len(data.dataset)] for i in range(n)]
        return {k: v.to("meta") for k, v in collate(samples).items()}

    autocast = torch.bfloat16 if t.precision == "bf16" else None
    try:
        with meta_stands_for(accelerator.device_type):
            profile = profile_activations(
                model,
                lambda batch: model(batch)["loss"],
                make_batch,
                blocks=find_blocks(model),
                autocast_dtype=autocast,
            )
    except (RuntimeError, NotImplementedError) as exc:  # an op without a meta kernel
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        warnings.warn(f"memory plan: the policy's meta probe failed ({reason})", stacklevel=2)
        return no_plan_line(f"the policy's forward did not run on the meta device: {reason}",
                            hint="set train.recompute to choose")  # fmt: skip
    moments = cfg.optim.moment_dtype
    pins = Pins(recompute=t.recompute, micro_batch=t.cuda_graph is True,
                moment_bytes=None if moments is None else MOMENT_BYTES[moments],
                master_storage=t.master_weight_storage if master_weights else None)  # fmt: skip
    adamw_masters = master_weights and cfg.optim.name == "adamw"
    return choose_plan(
        states,
        opt_layout,
        profile,
        micro_batch=layout.micro_batch,
        budget=budget,
        budget_source=source,
        pins=pins,
        allow_bf16_moments=adamw_masters,
        allow_bf16_sr=adamw_masters,
        recompute_modes=RECOMPUTE_MODES,
    )
