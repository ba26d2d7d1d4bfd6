"""Cross-field validation that runs before any heavy initialisation.

``validate(cfg, world_size)`` checks what no single field type can: the parallel
layout against the world size and the model shape, batch divisibility, choices
of string fields, and that paths exist. Every problem is collected and raised in
one ``ConfigError``; stacks add their own rules through ``Stack.validators``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from longboat.core.config.domains import check_domains
from longboat.core.config.errors import ConfigError, ConfigProblem, ProblemCollector
from longboat.core.config.schema import (
    FP8_RECIPES,
    LR_SCHEDULES,
    PARALLEL_STRATEGIES,
    PRECISIONS,
    RECOMPUTE_MODES,
)
from longboat.core.config.trackers import tracker_problems
from longboat.core.engine.memory.budget import check_memory_budget

HEAD_KEYS = ("num_attention_heads", "num_heads", "n_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "num_query_groups", "num_kv_heads", "n_kv_heads")
LAYER_KEYS = ("num_layers", "num_hidden_layers", "n_layers")
EXPERT_KEYS = ("num_experts", "num_moe_experts", "n_routed_experts")

CHOICES: dict[str, tuple[str, ...]] = {
    "parallel.strategy": PARALLEL_STRATEGIES,
    "train.precision": PRECISIONS,
    "train.fp8.recipe": FP8_RECIPES,
    "train.recompute": RECOMPUTE_MODES,
    "optim.schedule.name": LR_SCHEDULES,
    "optim.moment_dtype": ("fp32", "bf16"),
}
"""String fields whose values are a closed set."""

POSITIVE = (
    "parallel.tensor_parallel",
    "parallel.pipeline_parallel",
    "parallel.context_parallel",
    "parallel.expert_parallel",
    "parallel.data_parallel_replicate",
    "train.steps",
    "train.micro_batch_size",
    "train.log_every",
    "train.nan_guard.max_consecutive",
)
NON_NEGATIVE = (
    "train.eval_every",
    "checkpoint.every_steps",
    "checkpoint.keep_last",
    "data.num_workers",
    "optim.schedule.warmup_steps",
    "optim.weight_decay",
    "optim.grad_clip",
)


def _get(cfg: DictConfig, key: str) -> Any:
    """Value at a dotted path, or None when absent, missing or not resolvable."""
    try:
        return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    except OmegaConfBaseException:
        return None


def _first(model: Any, keys: tuple[str, ...]) -> tuple[str, Any]:
    if isinstance(model, DictConfig):
        for key in keys:
            if key in model:
                value = _get(model, key)
                if isinstance(value, int) and not isinstance(value, bool):
                    return key, value
    return "", None


def resolve_world_size(world_size: int | None) -> int | None:
    """``world_size`` or, when None, ``$WORLD_SIZE`` (set by torchrun); None if neither."""
    if world_size is not None:
        return world_size
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env and env.isdigit() else None


def _check_scalars(cfg: DictConfig, p: ProblemCollector) -> None:
    for key, choices in CHOICES.items():
        value = _get(cfg, key)
        if value is not None and value not in choices:
            p.add(key, "unsupported value", value=value, fix=f"use one of: {', '.join(choices)}")
    for key in POSITIVE:
        value = _get(cfg, key)
        if isinstance(value, int | float) and value < 1:
            p.add(key, "must be >= 1", value=value, fix=f"set {key} to a positive number")
    for key in NON_NEGATIVE:
        value = _get(cfg, key)
        if isinstance(value, int | float) and value < 0:
            p.add(key, "must be >= 0", value=value, fix=f"set {key}=0 or more")
    dp = _get(cfg, "parallel.data_parallel")
    if isinstance(dp, int) and dp != -1 and dp < 1:
        p.add("parallel.data_parallel", "must be >= 1 or -1 (infer)", value=dp, fix="use -1")
    vpp = _get(cfg, "parallel.virtual_pipeline_parallel")
    if vpp is not None:
        if vpp < 1:
            p.add("parallel.virtual_pipeline_parallel", "must be >= 1 or null", value=vpp)
        elif (_get(cfg, "parallel.pipeline_parallel") or 1) < 2 and vpp > 1:
            p.add(
                "parallel.virtual_pipeline_parallel",
                "interleaving needs pipeline parallelism",
                value=vpp,
                fix="set parallel.pipeline_parallel>=2 or parallel.virtual_pipeline_parallel=null",
            )
    train = _get(cfg, "train")
    if train is not None:
        check_memory_budget(train, p)
    betas = _get(cfg, "optim.betas")
    if betas is not None and (len(betas) != 2 or not all(0 <= b < 1 for b in betas)):
        p.add(
            "optim.betas", "must be two numbers in [0, 1)", value=list(betas), fix="e.g. [0.9,0.95]"
        )
    for key in ("optim.schedule.min_lr_ratio", "optim.schedule.wsd_decay_fraction"):
        value = _get(cfg, key)
        if isinstance(value, int | float) and not 0 <= value <= 1:
            p.add(key, "must lie in [0, 1]", value=value, fix=f"set {key} between 0 and 1")
    decay = _get(cfg, "ema.decay")
    if _get(cfg, "ema.enabled") and isinstance(decay, int | float) and not 0 < decay < 1:
        p.add("ema.decay", "must lie in (0, 1)", value=decay, fix="e.g. ema.decay=0.9999")
    if _get(cfg, "ema.enabled") and (_get(cfg, "ema.every") or 0) < 1:
        p.add("ema.every", "must be >= 1", value=_get(cfg, "ema.every"), fix="e.g. ema.every=1")
    if _get(cfg, "ema.enabled") and (_get(cfg, "ema.start_step") or 0) < 0:
        p.add("ema.start_step", "must be >= 0", value=_get(cfg, "ema.start_step"))
    if _get(cfg, "ema.export") and not _get(cfg, "ema.enabled"):
        p.add("ema.export", "there is no average to export", value=True,
              fix="set ema.enabled=true, or ema.export=false")  # fmt: skip
    if _get(cfg, "train.profiler.enabled"):
        start, end = _get(cfg, "train.profiler.start_step"), _get(cfg, "train.profiler.end_step")
        if isinstance(start, int) and isinstance(end, int) and start > end:
            p.add(
                "train.profiler.end_step",
                f"ends before train.profiler.start_step={start}",
                value=end,
                fix=f"set train.profiler.end_step>={start}",
            )


def _check_parallel(cfg: DictConfig, world_size: int | None, p: ProblemCollector) -> int | None:
    """Check the layout; return the (resolved) data-parallel size when known."""
    tp = _get(cfg, "parallel.tensor_parallel") or 1
    pp = _get(cfg, "parallel.pipeline_parallel") or 1
    cp = _get(cfg, "parallel.context_parallel") or 1
    ep = _get(cfg, "parallel.expert_parallel") or 1
    dp = _get(cfg, "parallel.data_parallel")
    if min(tp, pp, cp, ep) < 1:
        return None  # already reported by _check_scalars
    mp = tp * pp * cp
    layout = f"tp={tp} x pp={pp} x cp={cp}"
    resolved = dp if isinstance(dp, int) and dp >= 1 else None
    if world_size is not None:
        if world_size % mp != 0:
            p.add(
                "parallel",
                f"world size {world_size} is not divisible by {layout} = {mp}",
                fix="choose tensor/pipeline/context parallel sizes whose product divides the "
                "world size (number of processes)",
            )
            resolved = None
        elif dp == -1:
            resolved = world_size // mp
        elif resolved is not None and mp * resolved != world_size:
            p.add(
                "parallel.data_parallel",
                f"world size {world_size} != {layout} x dp={resolved} = {mp * resolved}",
                value=resolved,
                fix=f"set parallel.data_parallel={world_size // mp} or -1 (infer)",
            )
            resolved = None
    model = cfg.get("model") if isinstance(cfg, DictConfig) else None
    heads_key, heads = _first(model, HEAD_KEYS)
    if heads is not None and heads % tp != 0:
        p.add(
            "parallel.tensor_parallel",
            f"does not divide model.{heads_key}={heads}",
            value=tp,
            fix=f"use a tensor_parallel size that divides {heads}",
        )
    kv_key, kv = _first(model, KV_HEAD_KEYS)
    if kv is not None and heads_key and kv % tp != 0:
        p.add(
            "parallel.tensor_parallel",
            f"does not divide model.{kv_key}={kv}",
            value=tp,
            fix=f"use a tensor_parallel size that divides {kv}",
        )
    layers_key, layers = _first(model, LAYER_KEYS)
    vpp = _get(cfg, "parallel.virtual_pipeline_parallel") or 1
    if layers is not None and vpp >= 1 and layers % (pp * vpp) != 0:
        what = f"pp={pp}" + (f" x vpp={vpp}" if vpp > 1 else "")
        p.add(
            "parallel.pipeline_parallel",
            f"{what} does not divide model.{layers_key}={layers}",
            value=pp,
            fix=f"use pipeline stages (x virtual stages) that divide {layers}",
        )
    experts_key, experts = _first(model, EXPERT_KEYS)
    if experts is not None and experts % ep != 0:
        p.add(
            "parallel.expert_parallel",
            f"does not divide model.{experts_key}={experts}",
            value=ep,
            fix=f"use an expert_parallel size that divides {experts}",
        )
    if resolved is not None and (tp * resolved * cp) % ep != 0:
        # Expert-parallel groups are carved out of the tensor x data x context parallel ranks
        # of a pipeline stage (megatron-core with expert tensor parallel 1).
        p.add(
            "parallel.expert_parallel",
            f"does not divide tensor x data x context parallel = {tp} x {resolved} x {cp}",
            value=ep,
            fix=f"use an expert_parallel size that divides {tp * resolved * cp}",
        )
    strategy = _get(cfg, "parallel.strategy")
    replicate = _get(cfg, "parallel.data_parallel_replicate") or 1
    if strategy != "hsdp" and replicate != 1:
        p.add(
            "parallel.data_parallel_replicate",
            f"only applies to strategy=hsdp (strategy is {strategy!r})",
            value=replicate,
            fix="set parallel.strategy=hsdp or parallel.data_parallel_replicate=1",
        )
    elif resolved is not None and replicate >= 1 and resolved % replicate != 0:
        p.add(
            "parallel.data_parallel_replicate",
            f"does not divide the data-parallel size {resolved}",
            value=replicate,
            fix=f"use a replica count that divides {resolved}",
        )
    return resolved


def _check_batch(cfg: DictConfig, dp: int | None, p: ProblemCollector) -> None:
    from longboat.core.data.batch_plan import batch_size_problem

    gbs = _get(cfg, "train.global_batch_size")
    mbs = _get(cfg, "train.micro_batch_size")
    if gbs is None or not isinstance(mbs, int) or mbs < 1:
        return  # a bad micro-batch size is the schema's to report
    problem = batch_size_problem(gbs, mbs, dp)
    if problem is not None:
        p.problems.append(problem)


def _looks_remote(path: str) -> bool:
    return "://" in path


def _check_paths(cfg: DictConfig, p: ProblemCollector) -> None:
    data_path = _get(cfg, "data.path")
    if (
        isinstance(data_path, str)
        and data_path
        and not _looks_remote(data_path)
        and not Path(data_path).expanduser().exists()
    ):
        p.add(
            "data.path",
            "does not exist",
            value=data_path,
            fix="point data.path at an existing file or directory (or null for synthetic data)",
        )
    resume = _get(cfg, "checkpoint.resume")
    if (
        isinstance(resume, str)
        and resume not in ("auto", "none", "")
        and not _looks_remote(resume)
        and not Path(resume).expanduser().exists()
    ):
        p.add(
            "checkpoint.resume",
            "is not 'auto', 'none' or an existing checkpoint folder",
            value=resume,
            fix="use checkpoint.resume=auto (latest in checkpoint.dir), none, or a real path",
        )


def _as_dictconfig(cfg: Any) -> DictConfig:
    if isinstance(cfg, DictConfig):
        return cfg
    if dataclasses.is_dataclass(cfg) or isinstance(cfg, Mapping):
        return OmegaConf.structured(cfg) if dataclasses.is_dataclass(cfg) else OmegaConf.create(cfg)
    raise TypeError(f"validate() needs a DictConfig, dataclass or mapping, got {type(cfg)!r}")


def check_parallel(parallel: Any, world_size: int) -> int:
    """The data-parallel size of ``parallel`` (a ``ParallelConfig``) at ``world_size``, after
    the same layout checks ``validate`` runs (one ``ConfigError`` listing every problem)."""
    p = ProblemCollector()
    if not isinstance(world_size, int) or world_size < 1:
        p.add(None, "world size must be >= 1", value=world_size)
        p.raise_if_any()
    node = OmegaConf.create({"parallel": dataclasses.asdict(parallel)})
    _check_scalars(node, p)
    dp = _check_parallel(node, world_size, p)
    p.raise_if_any()
    assert dp is not None  # every problem that leaves it unknown was raised above
    return dp


def collect_problems(
    cfg: Any, world_size: int | None = None, *, stacks: Mapping[str, Any] | None = None
) -> list[ConfigProblem]:
    """Every cross-field problem of ``cfg`` (empty when valid); see ``validate``."""
    from longboat.core.stack import discover_stacks, resolve_ref

    node = _as_dictconfig(cfg)
    world_size = resolve_world_size(world_size)
    p = ProblemCollector()
    if world_size is not None and world_size < 1:
        p.add(None, "world size must be >= 1", value=world_size)
        world_size = None
    _check_scalars(node, p)
    check_domains(node, p)
    dp = _check_parallel(node, world_size, p)
    _check_batch(node, dp, p)
    _check_paths(node, p)
    tracker_problems(_get(node, "logging"), p)
    stack_name = _get(node, "stack")
    stacks = discover_stacks() if stacks is None else stacks
    stack = stacks.get(stack_name) if isinstance(stack_name, str) else None
    caps = getattr(stack, "capabilities", None)
    if caps is not None:
        from longboat.core.config.capabilities import capability_problems

        capability_problems(node, caps, stack_name, p)
    for validator in getattr(stack, "validators", ()):
        try:
            resolve_ref(validator)(node, world_size, p)
        except OmegaConfBaseException as exc:  # e.g. an interpolation that does not resolve
            reason = str(exc).splitlines()[0]
            p.add(exc.full_key or None, f"stack {stack_name!r} check failed: {reason}")
    return p.problems


def validate(cfg: Any, world_size: int | None = None) -> None:
    """Raise one ``ConfigError`` listing every cross-field problem of ``cfg``.

    Checks: world size == TP x PP x CP x DP (``world_size`` defaults to
    ``$WORLD_SIZE``; without either the layout-vs-world checks are skipped), TP
    divides attention (and KV) heads, PP (x VPP) divides layers, EP divides experts,
    global batch divisible by micro batch x DP, closed-set string fields, value
    ranges, and that ``data.path`` / a ``checkpoint.resume`` path exist. Accepts a
    composed DictConfig, an ``ExperimentConfig`` instance or a plain mapping.
    """
    problems = collect_problems(cfg, world_size)
    if problems:
        raise ConfigError(problems)


__all__ = ["CHOICES", "check_parallel", "collect_problems", "resolve_world_size", "validate"]
