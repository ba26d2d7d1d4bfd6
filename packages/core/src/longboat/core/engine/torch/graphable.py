"""The torch engine's sync-free step: one micro-batch, master weights, no host read.

``GraphableStep`` is the whole step as a function of tensors (the function ``GraphedStep``
captures as one CUDA graph), ``LaggedGuard`` the update gate that takes the NaN guard's
verdict one step late while the skip happens on the device, and ``run_step`` one trainer step
through them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from longboat.core.engine.device_skip import mark_non_finite
from longboat.core.engine.torch.master_weights import MasterWeightAdamW
from longboat.core.engine.torch.step import (
    StepResult,
    autocast_context,
    micro_batch_seed,
    scalar_extras,
    seeded_rng,
)
from longboat.core.loop.nan_guard import NaNGuard
from longboat.core.train.gate import LaggedUpdateGate, UpdateGate
from longboat.core.train.schedule import DeviceLRTable


class GraphableStep:
    """One optimizer step over ONE micro-batch, as a function of tensors only.

    ``step_fn(batch) -> {"loss", "grad_norm", <model scalars>}`` (device tensors) runs the
    forward (autocast), the backward, the grad cast / all-reduce / norm / clip, the
    ``MasterWeightAdamW`` update and the zeroing of the flat grad buffer, with no host sync
    (once the model's first value-check batches are past), no data-dependent shape, no
    host->device copy and no RNG seeding: the function ``GraphedStep`` captures as one CUDA
    graph. The caller seeds the RNG and puts the step's lr on the device around each call:
    ``run_step`` does both (and hands the step's values to the update gate after it).

    A non-finite grad norm skips the update on the device (``MasterWeightAdamW``'s
    ``found_inf``: masters, moments and step count untouched), and so does a non-finite
    (global) loss with ``skip_nonfinite_loss`` (default; the trainer ties it to
    ``train.nan_guard.enabled``): the step's ``found_inf`` is then exactly the NaN guard's
    verdict, so a skipped step never changed the weights and ``LaggedGuard`` can leave the
    host side of the guard for later.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        precision: str,
        device_type: str,
        grad_clip: float = 0.0,
        skip_nonfinite_loss: bool = True,
    ) -> None:
        if not isinstance(optimizer, MasterWeightAdamW):
            raise ValueError(
                "GraphableStep needs MasterWeightAdamW (train.master_weights=true): its update "
                f"keeps the lr and step count on the device; got {type(optimizer).__name__}"
            )
        if isinstance(model, DistributedDataParallel):
            raise ValueError(
                "GraphableStep takes the unwrapped model: MasterWeightAdamW all-reduces the "
                "flat grads itself (parallelize(..., master_weights=True) does not wrap)"
            )
        self.model = model
        self.optimizer = optimizer
        self.precision = precision
        self.device_type = device_type
        self.grad_clip = grad_clip
        self.skip_nonfinite_loss = skip_nonfinite_loss

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with autocast_context(self.precision, self.device_type):
            out = self.model(batch)
        loss = out["loss"]
        loss.backward()
        acc_dtype = torch.float64 if self.device_type == "cpu" else torch.float32
        extras = scalar_extras(out)
        names = sorted(extras)
        packed = torch.stack(
            [loss.detach().to(acc_dtype)] + [extras[k].reshape(()).to(acc_dtype) for k in names]
        )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
            packed = packed / dist.get_world_size()
        grad_norm = self.optimizer.prepare_grads(self.grad_clip)
        if self.skip_nonfinite_loss:
            # found_inf (set from the grad norm) |= the loss is not finite: the guard's rule.
            mark_non_finite(self.optimizer.found_inf, packed[0], keep=True)
        self.optimizer.step_on_device()
        self.optimizer.zero_grad()
        return {"loss": packed[0], "grad_norm": grad_norm, **dict(zip(names, packed[1:]))}


class LaggedGuard(LaggedUpdateGate):
    """The update gate of the master-weight step without a per-step host sync
    (``run_step(..., gate=LaggedGuard(...))``; core's trainer gets it from the
    ``Training``'s ``make_gate``, e.g. through ``engine.make_gate``).

    The skip itself happens on the device (``GraphableStep`` with ``skip_nonfinite_loss``),
    the lr comes from a core ``DeviceLRTable`` over the run schedule's ``LambdaLR`` (indexed
    by a device count of the updates taken, advanced by ``1 - found_inf``), and the host side
    (``NaNGuard`` counters, the abort, the host schedule) runs one step late through core's
    ``LaggedUpdateGate``: after step n is queued, step n-1's verdict is resolved, and the host
    schedule steps for it only when it was not skipped. So:

    - weights, losses, skip counters and the lr of every step (the step right after a skip
      included: it runs at the same lr as the skipped step, as with the synchronous guard)
      equal the synchronous guard's;
    - between two ``flush()`` calls the host schedule (``get_last_lr``, ``param_groups``'
      ``lr``) lags by the one unresolved step; ``flush()`` (before a checkpoint, a log line,
      the end or an interruption: the trainer calls it) makes it and the counters exact;
    - ``NonFiniteLossError`` for step n is raised while resolving it, i.e. after step n+1
      was queued: at most one step later than the synchronous guard.
    """

    def __init__(
        self,
        guard: NaNGuard,
        schedule: Any,
        optimizer: MasterWeightAdamW,
        *,
        total_steps: int,
        accelerator: Any = None,
    ) -> None:
        if not guard.cfg.enabled:
            raise ValueError(
                "LaggedGuard needs an enabled NaN guard (its device schedule skips with the "
                "device's found_inf); with train.nan_guard.enabled=false run the step with "
                "core's synchronous UpdateGate instead"
            )
        schedulers = getattr(schedule, "schedulers", None)
        if not schedulers or len(schedulers) != 1:
            raise ValueError(
                "LaggedGuard needs core's RunSchedule over the one MasterWeightAdamW "
                f"(longboat.core.train.RunSchedule([optimizer], ...)); got "
                f"{type(schedule).__name__}"
            )
        super().__init__(guard, schedule, accelerator)
        self.optimizer = optimizer
        self.lr = DeviceLRTable(
            schedulers[0], optimizer.lr_tensors, optimizer.found_inf, total_steps
        )

    def before_step(self) -> None:
        """This step's lr into the optimizer's lr tensors, on the device."""
        self.lr.load()

    def allow(self, step: int, loss: Any, grad_norm: Any = None) -> bool:
        """After the step: count its update on the device (unless ``found_inf`` skipped it),
        stage its values and resolve the older verdicts; True (the device decided)."""
        self.lr.advance()
        return super().allow(step, loss, grad_norm)


def run_step(
    step_fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    optimizer: MasterWeightAdamW,
    batch: dict[str, torch.Tensor],
    *,
    step: int,
    seed: int,
    rank_offset: int,
    device_type: str,
    device_index: int | None = None,
    gate: UpdateGate | None = None,
    host_sync: bool = True,
) -> StepResult:
    """One optimizer step through ``step_fn`` (a ``GraphableStep``, or a ``GraphedStep``
    wrapping one), equal to ``train_step`` with one micro-batch.

    Outside the (captured) function: the step's lr goes to the device, the RNG is seeded for
    micro-batch ``rank_offset`` of ``step`` (a CUDA graph replays from the generator's
    current seed and offset, so it draws what the eager step draws); after it, the gate sees
    the step's loss and grad norm. The outputs are cloned (a graph overwrites its static
    outputs on the next replay).

    ``gate``: core's synchronous ``UpdateGate`` (the lr is copied from the host param groups;
    ``allow`` reads the values: the step's one host sync; the update was already skipped on
    the device when they are not finite) or a ``LaggedGuard`` (no host sync: the lr comes
    from its device table and its verdict on this step is resolved after the next step is
    queued; ``stepped`` is then None). The schedule is the gate's (``gate.end_step()``, which
    core's trainer calls). Without a gate: the host lr, every update counted as taken.
    """
    lagged = gate is not None and gate.lagged
    if lagged:
        if not isinstance(gate, LaggedGuard):
            raise ValueError(
                f"run_step: a lagged gate must be a LaggedGuard (it holds the device lr table "
                f"the step reads); got {type(gate).__name__}"
            )
        gate.before_step()
    else:
        optimizer.sync_hyperparams()
    with seeded_rng(micro_batch_seed(seed, step, rank_offset), device_type, device_index):
        out = {k: v.clone() for k, v in step_fn(batch).items()}
    loss, grad_norm = out.pop("loss"), out.pop("grad_norm")
    stepped: bool | None = True
    if gate is not None:
        allowed = gate.allow(step, loss, grad_norm)
        stepped = None if lagged else allowed
    if not host_sync:
        return StepResult(loss=loss, grad_norm=grad_norm, stepped=stepped, metrics=out)
    names = sorted(out)
    host = torch.stack([loss.double(), grad_norm.double()] + [out[k].double() for k in names])
    values = host.cpu().tolist()
    return StepResult(
        loss=values[0], grad_norm=values[1], stepped=stepped, metrics=dict(zip(names, values[2:]))
    )
