"""megatron's distributed-optimizer update as one pass per parameter (the one-pass update).

megatron's ``DistributedOptimizer`` step, without Transformer Engine / apex, is three passes
over every parameter shard: the grad is cast from the bf16 grad buffer into an fp32 copy
(``_copy_model_grads_to_main_grads``), torch's AdamW updates the fp32 main weight and the
moments, and the updated main weight is copied back into the bf16 param buffer
(``_copy_main_params_to_model_params``), about 40 bytes of memory traffic a parameter.
``OnePassAdamW`` replaces the three with one fused AdamW kernel per shard (the stack passes
``longboat.kernels.adamw_master_step_``, whose signature ``MasterStepKernel`` spells out):
it reads the grad straight from the grad buffer, updates the main weight and moments in place
and writes the rounded weight into the param buffer (28 bytes a parameter with a bf16 grad
buffer), then runs the same param all-gather megatron does (skipped at one data-parallel
rank, where it would copy the buffer onto itself).

The state stays torch AdamW's (``step``, ``exp_avg``, ``exp_avg_sq`` per main param, in the
inner optimizer's ``state``), so checkpoints are interchangeable with megatron's own step.
The update rule is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction from the
step count); the learning rate comes from the param group each step (a device tensor the
lever keeps filled, or the group's own tensor once ``capturable_torch_adamw`` made it one, so
a captured CUDA graph reads the current value).

Gradient clipping happens on the device: the global grad norm is computed from the shards'
grads with megatron's own choice of grads (no shared or tensor-parallel duplicate parameter
counted twice) and reduction group, and the kernel divides the grads by
``max(1, (norm + 1e-6) / clip)`` (megatron multiplies by the inverse), so a clipped step has
no host read either (megatron's ``step()`` reads the norm with ``.item()``). ``step(found_inf=)``
skips the update on the device where that tensor is nonzero (every buffer and the step count
unchanged), as does a non-finite grad norm when clipping: the NaN guard's skip without a host
read (``engine.lagged_gate``).

``supported(optimizer)`` says whether an optimizer can take this path: megatron's
``DistributedOptimizer`` parts around torch ``AdamW`` (no amsgrad / maximize), no fp8 / fp4
param gather, no megatron-FSDP, no precision-aware optimizer. fp16 loss scaling, and clipping
over parts with different grad-statistics groups (expert-parallel parts), are not handled:
``step`` returns False for them, and the caller takes megatron's ``optimizer.step()``.

Moment storage (``moment_dtype``, ``optim.moment_dtype``): fp32, or bf16 (2 bytes a moment
element instead of 4; the kernel reads them to fp32, updates in fp32 and stores them rounded
to nearest even: changes numerics). bf16 moments are allocated in the inner optimizer's
``state`` when the update is built, before the first step, and are updated by the same kernel;
megatron's own step never runs on them: building the update refuses (``ConfigError``) a
configuration whose steps it would not take (``handles()`` False).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class MasterStepKernel(Protocol):
    """One AdamW step of an fp32 main weight in place (``longboat.kernels.adamw_master_step_``):
    reads ``grad`` (any float dtype, divided by ``grad_scale`` when given), updates ``master``,
    ``exp_avg`` and ``exp_avg_sq``, writes it rounded into ``param_out`` (None: no copy), and
    changes nothing where ``found_inf`` is nonzero."""

    def __call__(
        self,
        master: Tensor,
        grad: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        param_out: Tensor | None,
        *,
        lr: Tensor,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        step: Tensor,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> Any: ...


@dataclass
class _Shard:
    main: Tensor
    """The fp32 main weight (a param of the inner optimizer)."""
    grad: Tensor
    """Its gradient: a view of the DDP grad buffer (bf16 or fp32)."""
    out: Tensor | None
    """Where the rounded weight goes: a view of the DDP param buffer (None: ``main`` is the
    model parameter itself, an fp32 parameter)."""
    group: int


def _parts(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _why_not(part: Any) -> str | None:
    """None when ``part`` can take the one-pass update, else the reason."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(part, DistributedOptimizer):
        return f"{type(part).__name__} is not megatron's DistributedOptimizer"
    if getattr(part, "is_stub_optimizer", False):
        return "a stub optimizer (no parameters on this rank)"
    inner = getattr(part, "optimizer", None)
    if type(inner) is not torch.optim.AdamW:
        return f"the inner optimizer is {type(inner).__name__}, not torch.optim.AdamW"
    cfg, ddp = part.config, part.ddp_config
    if getattr(cfg, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        return "megatron's precision-aware optimizer"
    if ddp.use_megatron_fsdp or ddp.fp8_param_gather or getattr(ddp, "fp4_param_gather", False):
        return "megatron-FSDP or a quantized param gather"
    if getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return "MXFP8 param all-gather through the grad buffer"
    for group in inner.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            return "amsgrad / maximize"
    return None


def supported(optimizer: Any) -> str | None:
    """None when every part of ``optimizer`` takes the one-pass update, else why not."""
    for part in _parts(optimizer):
        reason = _why_not(part)
        if reason:
            return reason
    return None


class OnePassAdamW:
    """The one-pass update for a (chained) megatron distributed optimizer (module doc)."""

    def __init__(
        self, optimizer: Any, kernel: MasterStepKernel, moment_dtype: torch.dtype = torch.float32
    ) -> None:
        reason = supported(optimizer)
        if reason:
            raise ValueError(
                f"optim.one_pass_adamw: this optimizer cannot take the one-pass update "
                f"({reason}); set optim.one_pass_adamw=false"
            )
        self.optimizer = optimizer
        self.kernel = kernel
        """The per-shard update (``MasterStepKernel``)."""
        parts = _parts(optimizer)
        self.clip_norm = max(float(getattr(p.config, "clip_grad", 0.0) or 0.0) for p in parts)
        """The configured clipping norm (0: off)."""
        self._handles = not any(getattr(p, "grad_scaler", None) is not None for p in parts) and (
            self.clip_norm == 0.0
            or len({id(p.get_grad_stats_parallel_group()) for p in parts}) == 1
        )
        self.last_grad_norm: Tensor | None = None
        """The global grad norm of the latest clipped step (a device tensor; None without
        clipping, where the norm is not needed)."""
        self.moment_dtype = moment_dtype
        """The dtype of ``exp_avg`` / ``exp_avg_sq`` (fp32 or bf16)."""
        if moment_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"OnePassAdamW: moment_dtype={moment_dtype}; use fp32 or bf16")
        if moment_dtype != torch.float32:
            if not self._handles:
                from longboat.core.config.errors import ConfigError

                raise ConfigError(
                    "bf16 moments are kept by the one-pass AdamW update only, and this run's "
                    "steps go through megatron's torch AdamW (fp16 loss scaling, or clipping "
                    "over optimizer parts with different grad-statistics groups)",
                    key="optim.moment_dtype",
                    value="bf16",
                    fix="set optim.moment_dtype=fp32 (or null)",
                )
            for part, shards, _ in self.plans:
                for shard in shards:
                    self._state(shard, part.optimizer)

    @functools.cached_property
    def plans(self) -> list[tuple[Any, list[_Shard], list[Tensor]]]:
        """Per optimizer part: the part, its shards, one device LR tensor per param group
        (built on first use: views of megatron's buffers, which stay in place)."""
        plans = []
        for part in _parts(self.optimizer):
            inner = part.optimizer
            group_of = {id(p): g for g, grp in enumerate(inner.param_groups) for p in grp["params"]}
            shards: list[_Shard] = []
            pairs = [
                (model, main, True)
                for models, mains in zip(
                    part.model_float16_groups, part.shard_fp32_from_float16_groups
                )
                for model, main in zip(models, mains)
            ] + [
                (model, main, False)
                for models, mains in zip(part.model_fp32_groups, part.shard_fp32_groups)
                for model, main in zip(models, mains)
            ]
            for model, main, half in pairs:
                ranges = part._get_model_param_range_map(model)
                prange, wrange = ranges["param"], ranges["gbuf_world_in_bucket"]
                grad = model.main_grad.view(-1)[prange.start : prange.end]
                out = None
                if half:
                    gbuf, _, bucket = part.model_param_gbuf_map[model]
                    data = part.buffers[gbuf].buckets[bucket].param_data
                    out = data.view(-1)[wrange.start : wrange.end]
                shards.append(_Shard(main=main, grad=grad, out=out, group=group_of[id(main)]))
            lrs = [
                torch.zeros((), dtype=torch.float32, device=grp["params"][0].device)
                if grp["params"]
                else torch.zeros(())
                for grp in inner.param_groups
            ]
            plans.append((part, shards, lrs))
        return plans

    def handles(self) -> bool:
        """Whether ``step`` takes this configuration (fp16 loss scaling: no; clipping: where
        every part reduces its grad statistics over the same group)."""
        return self._handles

    @functools.cached_property
    def norm_grads(self) -> list[Tensor]:
        """The grads megatron's norm counts: those of params that are neither shared nor
        tensor-parallel duplicates."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        return [
            s.grad
            for _, shards, _ in self.plans
            for s in shards
            if param_is_not_shared(s.main) and param_is_not_tensor_parallel_duplicate(s.main)
        ]

    @torch.no_grad()
    def device_grad_norm(self) -> Tensor:
        """The global L2 norm of the grads on the device (megatron's ``get_grad_norm`` without
        its host read), summed over the grad-statistics group."""
        part, _, lrs = self.plans[0]
        total = torch.zeros((), dtype=torch.float32, device=lrs[0].device)
        if self.norm_grads:
            norms = torch._foreach_norm(self.norm_grads, 2.0, dtype=torch.float32)
            total = torch.stack(norms).square().sum()
        group = part.get_grad_stats_parallel_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return total.sqrt()

    @torch.no_grad()
    def step(self, found_inf: Tensor | None = None) -> bool:
        """One update of every shard (skipped on the device where ``found_inf`` is nonzero);
        False (nothing done) where ``handles()`` is False."""
        if not self._handles:
            return False
        grad_scale = None
        if self.clip_norm > 0.0:
            norm = self.device_grad_norm()
            self.last_grad_norm = norm
            grad_scale = torch.clamp((norm + 1.0e-6) / self.clip_norm, min=1.0)
            bad = torch.isfinite(norm).logical_not().float()
            found_inf = bad if found_inf is None else torch.maximum(found_inf.float(), bad)
        for part, shards, lrs in self.plans:
            inner = part.optimizer
            steps = []
            for shard in shards:
                steps.append(self._state(shard, inner)["step"])
            if steps:
                torch._foreach_add_(steps, 1.0)
                if found_inf is not None:  # a skipped update does not count
                    skipped = found_inf.reshape(()).to(steps[0])
                    torch._foreach_sub_(steps, [skipped] * len(steps))
            group_lr = []
            for grp, lr in zip(inner.param_groups, lrs):
                if isinstance(grp["lr"], Tensor):
                    group_lr.append(grp["lr"])
                else:
                    lr.fill_(float(grp["lr"]))
                    group_lr.append(lr)
            for shard in shards:
                grp = inner.param_groups[shard.group]
                state = inner.state[shard.main]
                beta1, beta2 = grp["betas"]
                self.kernel(
                    shard.main,
                    shard.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    shard.out,
                    lr=group_lr[shard.group],
                    beta1=float(beta1),
                    beta2=float(beta2),
                    eps=float(grp["eps"]),
                    weight_decay=float(grp["weight_decay"]),
                    step=state["step"],
                    grad_scale=grad_scale,
                    found_inf=found_inf,
                )
            self._sync_params(part)
        return True

    def _state(self, shard: _Shard, inner: Any) -> dict[str, Tensor]:
        """``shard``'s AdamW state in ``inner`` (its torch AdamW), allocated where empty: torch
        AdamW's layout (fused: the step a device tensor), the moments in ``moment_dtype``."""
        state = inner.state[shard.main]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=shard.main.device)
            state["exp_avg"] = torch.zeros_like(shard.main, dtype=self.moment_dtype)
            state["exp_avg_sq"] = torch.zeros_like(shard.main, dtype=self.moment_dtype)
        return state

    @staticmethod
    def _sync_params(part: Any) -> None:
        """megatron's param all-gather after the update (what ``step_with_ready_grads`` does),
        skipped at one rank (nothing to gather) and under ``overlap_param_gather`` (the next
        forward gathers)."""
        if part.ddp_config.overlap_param_gather:
            return
        group = getattr(part, "data_parallel_group", None)
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        part.start_param_sync_for_bucket_group_subset()

    def logged_grad_norm(self) -> Any:
        """The step's grad norm for a log line: the clipped step's device norm, else
        ``grad_norm()``."""
        return self.last_grad_norm if self.last_grad_norm is not None else self.grad_norm()

    def grad_norm(self) -> Any:
        """The global grad norm of the step just taken (grads stay in the buffer until
        ``zero_grad``), through megatron's own norm (its duplicate filtering and reduction
        over ranks): the shards' grads are given to the main params as fp32 for the call and
        taken back. For log steps only: that is the cast pass the update avoids."""
        for _, shards, _ in self.plans:
            for shard in shards:
                shard.main.grad = shard.grad.float()
        try:
            return self.optimizer.get_grad_norm()
        finally:
            for _, shards, _ in self.plans:
                for shard in shards:
                    shard.main.grad = None
