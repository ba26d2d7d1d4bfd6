"""Distributed-optimizer glue: longboat's ``OptimConfig`` -> megatron DDP + optimizer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import OptimConfig

_PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wrap_ddp(
    chunks: list[torch.nn.Module],
    *,
    distributed_optimizer: bool = False,
    overlap_grad_reduce: bool = False,
    grad_reduce_in_fp32: bool = True,
    side_stream: bool = False,
) -> list[torch.nn.Module]:
    """Wrap each model chunk in megatron's ``DistributedDataParallel`` (fp32 grad buffers;
    ``grad_reduce_in_fp32=False``: in the parameters' dtype, where
    ``wgrad_fusion.single_pass_grads`` says that holds the same values). ``side_stream``:
    constructed under a side stream, as a step captured as a CUDA graph needs
    (``engine.ddp.construction_stream``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from longboat.core.megatron.engine.ddp import construction_stream

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=distributed_optimizer,
    )
    with construction_stream(side_stream):
        return [
            DistributedDataParallel(config=c.config, ddp_config=ddp_cfg, module=c) for c in chunks
        ]


def release_ddp(modules: Iterable[torch.nn.Module]) -> None:
    """Let a finished run's model, grad buffers and optimizer be freed; the modules cannot
    train after it.

    megatron's ``DistributedDataParallel`` keeps every parameter's grad-accumulation node in
    ``grad_accs``, and each node holds a hook that holds the DDP itself. The cycle runs through
    autograd's C++ nodes, which Python's collector cannot see, so without this the model, its
    buffers and everything they reach outlive the run for the life of the process (a notebook,
    a sweep, a benchmark of several runs). Dropping the nodes frees their hooks, unless a
    tensor that still carries a step's autograd graph reaches them: such tensors kept as
    attributes of the modules or of the plain objects they hold (e.g. megatron's token
    dispatcher keeps the last routing probabilities) are dropped too."""
    for module in modules:
        accs = getattr(module, "grad_accs", None)
        if isinstance(accs, list):
            accs.clear()
        for sub in module.modules():
            owners = [sub, *(v for v in vars(sub).values() if _plain_object(v))]
            for owner in owners:
                for name, value in list(vars(owner).items()):
                    if _holds_graph(value):
                        setattr(owner, name, None)


def _plain_object(value: object) -> bool:
    return hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module | type)


def _holds_graph(value: object) -> bool:
    if isinstance(value, tuple | list):
        return any(_holds_graph(v) for v in value)
    return isinstance(value, torch.Tensor) and value.grad_fn is not None


def build_optimizer(
    ddp_chunks: list[torch.nn.Module],
    optim: OptimConfig,
    *,
    precision: str = "fp32",
    distributed_optimizer: bool = False,
    lr_scale: Mapping[str, tuple[Iterable[torch.nn.Parameter], float]] | None = None,
) -> Any:
    """megatron optimizer for ``optim`` (adamw / sgd), fp32 main params under bf16 / fp16.

    ``lr_scale``: ``{name: (parameters, factor)}``, parameter sets that train at ``factor``
    times ``optim.lr`` (``scaled_lr_groups``); the run's LR schedule scales them alike.

    ``optim.fused`` (default) runs torch's fused AdamW on CUDA when megatron falls back to
    torch's optimizer (no Transformer Engine / apex): see ``use_fused_torch_adamw``.

    ``distributed_optimizer`` shards optimizer state over data-parallel ranks (ZeRO-1;
    megatron supports it for Adam only).

    ``optim.moment_dtype=bf16`` is not set up here: the one-pass update keeps bf16 moments
    (``MegatronStepEngine.use_one_pass``, which refuses it where that update does not take
    every step).
    """
    from megatron.core.optimizer import OptimizerConfig

    kinds = {"adamw": "adam", "sgd": "sgd"}
    if optim.name not in kinds:
        raise ConfigError(
            f"optim.name={optim.name!r}: the megatron backend supports {sorted(kinds)}.",
            key="optim.name",
        )
    if distributed_optimizer and optim.name != "adamw":
        raise ConfigError(
            "megatron's distributed optimizer supports Adam(W) only. Fix: optim.name=adamw "
            "or turn the distributed optimizer off.",
            key="optim.name",
            value=optim.name,
        )
    if precision not in _PARAM_DTYPES:
        raise ConfigError(f"train.precision={precision!r}: expected fp32, bf16 or fp16.")
    cfg = OptimizerConfig(
        optimizer=kinds[optim.name],
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=float(optim.betas[0]),
        adam_beta2=float(optim.betas[1]),
        adam_eps=optim.eps,
        clip_grad=optim.grad_clip,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=_PARAM_DTYPES[precision],
        use_distributed_optimizer=distributed_optimizer,
    )
    optimizer = megatron_optimizer(cfg, ddp_chunks, fused=optim.fused, lr_scale=lr_scale)
    fuse_main_param_copies(optimizer)
    return optimizer


def megatron_optimizer(
    cfg: Any,
    ddp_chunks: list[torch.nn.Module],
    *,
    fused: bool,
    lr_scale: Mapping[str, tuple[Iterable[torch.nn.Parameter], float]] | None = None,
) -> Any:
    """megatron's optimizer for ``cfg`` (an ``OptimizerConfig``) over ``ddp_chunks`` as
    longboat runs it: each group's weight decay scaled by its ``wd_mult``
    (``apply_weight_decay_multipliers``), the parameter sets of ``lr_scale`` in groups of
    their own learning rate (``scaled_lr_groups``) and, with ``fused``, torch's fused AdamW on
    CUDA (``use_fused_torch_adamw``)."""
    from megatron.core.optimizer import get_megatron_optimizer

    overrides = scaled_lr_groups(cfg, lr_scale) if lr_scale else None
    optimizer = get_megatron_optimizer(cfg, ddp_chunks, config_overrides=overrides)
    apply_weight_decay_multipliers(optimizer, cfg.weight_decay)
    for inner in inner_optimizers(optimizer):  # the schedule scales each group's start lr
        for group in inner.param_groups:
            group["lr"] = float(group.get("max_lr", cfg.lr))
    if fused:
        use_fused_torch_adamw(optimizer)
    return optimizer


def fuse_main_param_copies(optimizer: Any) -> int:
    """Copy the updated fp32 main shards into the model's parameter buffers in fused kernels.

    After each step megatron's distributed optimizer copies every main shard into its slice
    of the DDP parameter buffer one ``copy_`` at a time, looking the slice up anew each step
    (~600 launches plus their Python for a 3B VLM). This replaces that method on the plain
    configurations (no megatron-FSDP, precision-aware optimizer or FP8 / FP4 parameter
    gather) with one ``torch._foreach_copy_`` over slices looked up once: the buffers are
    allocated with the DDP wrapper and never move. Returns how many optimizers were changed.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    changed = 0
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if not isinstance(part, DistributedOptimizer) or part.is_stub_optimizer:
            continue
        ddp, cfg = part.ddp_config, part.config
        if (
            ddp.use_megatron_fsdp
            or ddp.fp8_param_gather
            or getattr(ddp, "fp4_param_gather", False)
            or cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            or cfg.reuse_grad_buf_for_mxfp8_param_ag
        ):
            continue
        part._copy_main_params_to_model_params = _fused_param_copy(part)
        changed += 1
    return changed


def _fused_param_copy(part: Any) -> Any:
    pairs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def slices() -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        # The same slices megatron's _copy_main_params_to_model_params writes.
        out = []
        groups = [(part.shard_fp32_from_float16_groups, part.model_float16_groups),
                  (part.shard_fp32_groups, part.model_fp32_groups)]  # fmt: skip
        for shard_groups, model_groups in groups:
            for shard_group, model_group in zip(shard_groups, model_groups, strict=True):
                dst, src = [], []
                for main, param in zip(shard_group, model_group, strict=True):
                    world = part._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                    gbuf, _, bucket = part.model_param_gbuf_map[param]
                    buffer = part.buffers[gbuf].buckets[bucket].param_data.view(-1)
                    dst.append(buffer[world.start : world.end])
                    src.append(main)
                if dst:
                    out.append((dst, src))
        return out

    @torch.no_grad()
    def copy_main_params_to_model_params() -> None:
        if not pairs:
            pairs.extend(slices())
        for dst, src in pairs:
            torch._foreach_copy_(dst, src)

    return copy_main_params_to_model_params


def scaled_lr_groups(
    cfg: Any, lr_scale: Mapping[str, tuple[Iterable[torch.nn.Parameter], float]]
) -> dict[Any, Any]:
    """megatron's ``config_overrides``: its standard ones (no weight decay on biases and 1-D
    parameters) and, for each ``name: (parameters, factor)`` of ``lr_scale``, a peak learning
    rate of ``factor * cfg.lr`` for those parameters (matched by identity, so the names the
    DDP wrapper gives them do not matter)."""
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

    overrides = get_standard_config_overrides(cfg)
    for name, (params, factor) in lr_scale.items():
        ids = frozenset(id(p) for p in params)
        match = ParamPredicate(name=f"lr_scale:{name}", fn=lambda p, ids=ids: id(p) in ids)
        overrides[ParamKey(predicate=match)] = {"max_lr": float(factor) * cfg.lr}
    return overrides


def apply_weight_decay_multipliers(optimizer: Any, weight_decay: float) -> None:
    """Set each param group's weight decay to ``weight_decay`` times the group's ``wd_mult``.

    megatron's optimizer puts biases and the other 1-D parameters (norm weights) in groups
    with ``wd_mult=0``, as the Hugging Face Trainer exempts them, but gives every group
    ``weight_decay`` itself: only megatron's own ``OptimizerParamScheduler`` applies the
    multiplier, and longboat's run schedule (``core.train.schedule``) sets learning rates
    only. Without this every parameter decayed."""
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            group["weight_decay"] = float(weight_decay) * float(group.get("wd_mult", 1.0))


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a (chained) megatron optimizer."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [p.optimizer for p in parts if getattr(p, "optimizer", None) is not None]


def checkpoint_above_precision(checkpoint: Any, precision: str) -> bool:
    """Whether training at ``precision`` from ``checkpoint`` (a safetensors file or folder)
    should start its main weights from the checkpoint's values (``start_main_weights``):
    bf16 / fp16 training and an fp32 tensor in the checkpoint (a bf16 checkpoint is already
    on the bf16 grid)."""
    from longboat.core.hf import safetensors_dtypes

    return precision in ("bf16", "fp16") and "F32" in safetensors_dtypes(checkpoint)


@torch.no_grad()
def start_main_weights(
    optimizer: Any, model: torch.nn.Module, values: Mapping[str, torch.Tensor]
) -> int:
    """Start megatron's distributed optimizer's fp32 main weights from ``values`` (parameter
    name in ``model`` -> its full-precision tensor, this rank's shape) instead of the model's
    rounded bf16 / fp16 parameters; returns how many parameters were set.

    Training from an fp32 checkpoint in bf16 otherwise starts every main weight on the bf16
    grid, and the first updates, smaller than half a bf16 step, leave the model's weights
    where they were until they add up to one, where fp32 weights would have moved from the
    start. Only this rank's shard of each main weight is written (megatron's own parameter
    ranges); parameters absent from ``values`` keep their main weights.
    """
    shapes = dict(model.named_parameters())
    done = 0
    for name, (start, end, main) in main_weight_shards(optimizer, model).items():
        src = values.get(name)
        if src is None:
            continue
        if src.shape != shapes[name].shape:
            raise ValueError(
                f"start_main_weights: {name}: a value of shape {tuple(src.shape)} for a "
                f"parameter of shape {tuple(shapes[name].shape)}"
            )
        main.copy_(src.reshape(-1)[start:end].to(main.device, main.dtype))
        done += 1
    return done


def main_weight_shards(
    optimizer: Any, model: torch.nn.Module
) -> dict[str, tuple[int, int, torch.Tensor]]:
    """This rank's fp32 main-weight shards of ``model``'s bf16 / fp16 parameters in megatron's
    distributed optimizer: parameter name -> ``(start, end, shard)``, the shard holding
    elements ``start:end`` of the flattened parameter (the live tensor: writing it sets the
    main weight). Parameters of which this rank holds nothing are absent."""
    names = {p: n for n, p in model.named_parameters()}
    out: dict[str, tuple[int, int, torch.Tensor]] = {}
    for opt in _distributed_parts(optimizer):
        for model_group, main_group in zip(
            opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True
        ):
            for param, main in zip(model_group, main_group, strict=True):
                if param in names:
                    r = opt._get_model_param_range_map(param)["param"]
                    out[names[param]] = (r.start, r.end, main.data)
    return out


def _distributed_parts(optimizer: Any) -> list[Any]:
    """The distributed optimizers inside a (chained) megatron optimizer; ValueError if one
    is not (only the distributed optimizer keeps main-weight shards this helper can write)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for part in parts:
        if not hasattr(part, "shard_fp32_from_float16_groups"):
            raise ValueError(
                f"main weights by parameter need megatron's distributed optimizer, got "
                f"{type(part).__name__}"
            )
    return list(parts)


class MegatronOptimizerState:
    """This rank's shard of the distributed optimizer as a ``state_dict`` (saved per rank).

    Holds the fp32 main weights (in bf16 training they differ from the model's bf16 weights)
    and the inner optimizer's moments, step counts and param groups (the live LR). The state
    is saved as each rank's own tensors (``torch.save`` of the core checkpoint's per-rank
    file): the moments in the dtype the run keeps them in, bf16 with ``optim.moment_dtype=
    bf16``.

    Loading puts each AdamW moment into the dtype this run keeps it in (its allocated state's,
    else the main weight's, fp32), copied straight from the loaded tensor: a bf16 checkpoint
    resumes bf16 moments bit for bit, and a checkpoint of the other moment dtype converts,
    bf16 -> fp32 exactly, fp32 -> bf16 rounded to nearest (the run then continues as a
    bf16-moment run does; the changed ``optim.moment_dtype`` is among the keys a resumed run
    announces). torch's own ``load_state_dict`` would cast every moment to the main weight's
    dtype (an fp32 copy of bf16 moments on the device).
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        out = []
        for opt in inner_optimizers(self.optimizer):
            params = [p for g in opt.param_groups for p in g["params"]]
            sd = opt.state_dict()
            out.append(
                {
                    "main": [p.detach().clone() for p in params],
                    "state": sd["state"],
                    # The live LR sits in the param groups (schedulers only set it on step()).
                    "param_groups": sd["param_groups"],
                }
            )
        return {"optimizers": out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["optimizers"]
        opts = inner_optimizers(self.optimizer)
        if len(saved) != len(opts):
            raise ValueError(
                f"the checkpoint holds {len(saved)} optimizer shard(s), this run has "
                f"{len(opts)}: resume with the same parallel layout and model"
            )
        with torch.no_grad():
            for opt, part in zip(opts, saved, strict=True):
                params = [p for g in opt.param_groups for p in g["params"]]
                if len(params) != len(part["main"]):
                    raise ValueError("optimizer shard layout differs from the checkpoint's")
                for p, value in zip(params, part["main"], strict=True):
                    p.copy_(value)
                kept = {p: _moment_dtype(opt.state.get(p), p) for p in params}
                sd = opt.state_dict()
                sd["state"] = {
                    i: {k: v for k, v in s.items() if k not in MOMENT_KEYS}
                    for i, s in part["state"].items()
                }
                sd["param_groups"] = part["param_groups"]
                opt.load_state_dict(sd)  # step counts and param groups by torch's rules
                ids = [i for g in part["param_groups"] for i in g["params"]]
                for i, p in zip(ids, params, strict=True):
                    for key, value in part["state"].get(i, {}).items():
                        if key in MOMENT_KEYS:
                            opt.state[p][key] = value.to(p.device, kept[p], copy=True)


MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
"""AdamW's moments in a torch optimizer's per-parameter state."""


def _moment_dtype(state: Mapping[str, Any] | None, param: torch.Tensor) -> torch.dtype:
    """The dtype a run keeps ``param``'s moments in: its allocated state's (bf16 moments are
    allocated before the first step), else the parameter's."""
    moment = (state or {}).get("exp_avg")
    return moment.dtype if isinstance(moment, torch.Tensor) else param.dtype


def _torch_adam_groups(optimizer: Any, device_types: tuple[str, ...]) -> Iterator[dict]:
    """The param groups of megatron's inner torch Adam / AdamW whose parameters are all on
    ``device_types`` (TE / apex optimizers and empty groups are skipped)."""
    for inner in inner_optimizers(optimizer):
        if not isinstance(inner, torch.optim.AdamW | torch.optim.Adam):
            continue
        for group in inner.param_groups:
            params = group["params"]
            if params and all(p.device.type in device_types for p in params):
                yield group


def capturable_torch_adamw(optimizer: Any, device_types: tuple[str, ...] = ("cuda",)) -> int:
    """Set megatron's inner torch Adam / AdamW up for a step captured as a CUDA graph.

    A captured step replays the kernels it recorded with the values they read: a Python
    float ``lr`` would be frozen at its capture-time value, and torch refuses to capture
    ``step()`` unless the param group is ``capturable``. Each group on ``device_types`` gets
    ``capturable=True`` and its ``lr`` as a 0-d fp32 tensor on the parameters' device; an LR
    scheduler then ``fill_``s it in place (no host sync), so every replay reads the current
    LR. Create the LR scheduler BEFORE calling this: a scheduler created afterwards starts
    from a device-tensor ``initial_lr`` and reads it on the host at every ``step()``.
    Returns how many param groups were set up.
    """
    groups = list(_torch_adam_groups(optimizer, device_types))
    for group in groups:
        group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor):
            device = group["params"][0].device
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
    return len(groups)


def use_fused_torch_adamw(optimizer: Any) -> int:
    """Switch megatron's torch AdamW fallback to torch's fused (single-kernel) AdamW on CUDA.

    Without Transformer Engine or apex megatron builds ``torch.optim.AdamW`` with torch's
    default ``foreach`` implementation (a dozen multi-tensor kernels per step); ``fused=True``
    is the same update rule in one kernel per parameter group chunk, and what Hugging Face
    users run. Param groups whose parameters are not all on CUDA (CPU runs, offloading) and
    TE / apex optimizers are left alone. Returns how many param groups were switched.
    """
    switched = 0
    for group in _torch_adam_groups(optimizer, ("cuda",)):
        if not all(p.is_floating_point() for p in group["params"]):
            continue
        if group.get("fused") or group.get("capturable"):
            continue  # already fused, or set up for CUDA-graph capture: megatron's choice
        group["fused"], group["foreach"] = True, False
        switched += 1
    return switched


def optimizer_step(optimizer: Any) -> tuple[bool, Any]:
    """One megatron optimizer step; ``(stepped, grad_norm)``.

    ``optimizer.step()`` always computes the global grad norm and reads it on the host
    (``.item()``), a device sync every step. When gradient clipping is off (``clip_grad ==
    0``) and there is no loss scaler (bf16 / fp32), the norm is not needed: this runs
    ``prepare_grads()`` + ``step_with_ready_grads()`` (the same update) without the sync and
    returns ``grad_norm=None`` (call ``optimizer.get_grad_norm()`` on the steps that log it,
    before ``zero_grad``). With clipping or fp16 loss scaling it is ``optimizer.step()``.
    """
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    clip = any(float(getattr(p.config, "clip_grad", 0.0) or 0.0) > 0.0 for p in parts)
    scaled = any(getattr(p, "grad_scaler", None) is not None for p in parts)
    if clip or scaled:
        ok, grad_norm, _ = optimizer.step()
        return bool(ok), grad_norm
    if hasattr(optimizer, "grad_norms_by_group"):
        optimizer.grad_norms_by_group = {}
    optimizer.prepare_grads()  # no scaler: never finds inf (that needs the scaler's check)
    return bool(optimizer.step_with_ready_grads()), None
