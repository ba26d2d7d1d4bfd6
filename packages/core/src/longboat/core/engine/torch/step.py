"""The torch engine's eager step: one optimizer step over gradient-accumulated micro-batches,
identical at any world size.

Every micro-batch of a global batch has a global index ``m`` (0..dp*accum-1):
rank ``r`` runs micro-batches ``r*accum .. r*accum+accum-1``. Before each one, the
RNG (a model's noise, dropout) is re-seeded from (seed, step, m), so
world size 1 with accumulation N and world size N without accumulation compute
the same losses and, up to summation order, the same gradients. The same seeding
makes a resumed run reproduce the uninterrupted one regardless of RNG history.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from longboat.core.engine.torch.master_weights import MasterWeightAdamW
from longboat.core.engine.torch.optim import clip_grad_norm_
from longboat.core.train.gate import UpdateGate

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def micro_batch_seed(seed: int, step: int, micro_index: int) -> int:
    """Deterministic 63-bit seed for one micro-batch of one step."""
    value = (seed * 6364136223846793005 + step * 1442695040888963407 + micro_index) & (2**63 - 1)
    return value ^ (value >> 29)


@contextlib.contextmanager
def seeded_rng(seed: int, device_type: str, device_index: int | None = None) -> Iterator[None]:
    """Fork the CPU and device RNGs, seed them, and restore them on exit.

    Only this process's device is forked when ``device_index`` is given (forking every
    visible GPU's generator on each micro-batch would cost a sync per device)."""
    # devices=[] forks only the CPU generator.
    kwargs: dict[str, Any] = {"devices": []}
    if device_type != "cpu":
        kwargs = {"device_type": device_type}
        if device_index is not None:
            kwargs["devices"] = [device_index]
    with torch.random.fork_rng(**kwargs):
        torch.manual_seed(seed)
        yield


@dataclass
class StepResult:
    """What one optimizer step measured.

    With ``train_step(..., host_sync=False)`` ``loss``, ``grad_norm`` and the ``metrics``
    values are 0-dim device tensors (read them with ``float()`` when logging); otherwise
    Python floats."""

    loss: Any
    """Mean loss over every micro-batch of the global batch (all ranks)."""
    grad_norm: Any
    """Global grad norm before clipping."""
    stepped: bool | None
    """False when the NaN guard skipped the update; None when the verdict comes later
    (``run_step(..., gate=LaggedGuard(...))``: see ``LaggedGuard.last``, in
    ``graphable``)."""
    metrics: dict[str, Any]
    """Extra scalars the model returned (averaged over the global batch)."""


def _no_sync(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on all but the last micro-batch."""
    if last:
        return contextlib.nullcontext()
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def _set_fsdp_sync(model: nn.Module, sync: bool) -> None:
    setter = getattr(model, "set_requires_gradient_sync", None)
    if callable(setter):
        setter(sync)


def autocast_context(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for bf16/fp16, a no-op for fp32."""
    dtype = _DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def scalar_extras(out: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The scalar tensors of a model's output other than ``loss`` (detached): reported
    metrics."""
    return {
        k: v.detach()
        for k, v in out.items()
        if k != "loss" and isinstance(v, torch.Tensor) and v.numel() == 1
    }


def clip_and_measure(
    model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float
) -> torch.Tensor:
    """Global grad norm (device tensor, before clipping), clipping to ``grad_clip`` when > 0.

    ``MasterWeightAdamW`` casts/reduces its flat grads and folds the clip into its step;
    other optimizers clip the params' grads in place."""
    if isinstance(optimizer, MasterWeightAdamW):
        return optimizer.prepare_grads(grad_clip)
    return clip_grad_norm_([p for p in model.parameters() if p.requires_grad], grad_clip)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[Any],
    *,
    step: int,
    seed: int,
    rank_offset: int,
    device_type: str,
    device_index: int | None = None,
    precision: str = "fp32",
    grad_clip: float = 0.0,
    gate: UpdateGate | None = None,
    host_sync: bool = True,
) -> StepResult:
    """Forward/backward ``micro_batches`` (this rank's share), then one optimizer step.

    ``rank_offset`` is the global index of this rank's first micro-batch
    (``dp_rank * accum``); ``device_index`` is this process's device (None on CPU).
    ``model(batch)`` must return a dict with a scalar
    ``loss``; other scalar entries are averaged and reported. ``gate`` (core's synchronous
    ``UpdateGate``: the NaN guard) sees the global loss and grad norm and may veto the
    update; it is the step's only host sync when ``host_sync=False`` (then the result holds
    device tensors, see ``StepResult``). The LR schedule is the gate's to advance
    (``gate.end_step()``, which core's trainer calls after the step): a skipped update does
    not advance it. Without a gate every update is applied.
    """
    if gate is not None and gate.lagged:
        raise ValueError(
            "train_step takes a synchronous UpdateGate: its optimizer cannot skip a "
            "non-finite update on the device, so it must know the verdict before updating. "
            "Fix: run a lagged gate through run_step with a GraphableStep"
        )
    accum = len(micro_batches)
    # float64 sums on the host's CPU runs (exact across world sizes); fp32 on devices.
    acc_dtype = torch.float64 if device_type == "cpu" else torch.float32
    total_loss: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(micro_batches):
        last = i == accum - 1
        _set_fsdp_sync(model, last)
        with (
            _no_sync(model, last),
            seeded_rng(micro_batch_seed(seed, step, rank_offset + i), device_type, device_index),
        ):
            with autocast_context(precision, device_type):
                out = model(batch)
            loss = out["loss"]
            (loss / accum).backward()
        value = loss.detach().to(acc_dtype)
        total_loss = value if total_loss is None else total_loss + value
        for key, v in scalar_extras(out).items():
            v = v.reshape(()).to(acc_dtype)
            extras[key] = extras[key] + v if key in extras else v
    assert total_loss is not None, "train_step needs at least one micro-batch"
    names = sorted(extras)
    packed = torch.stack([total_loss] + [extras[k] for k in names]) / accum
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # gloo reduces CPU tensors (and has no AVG); NCCL needs them on the device.
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        packed = packed / dist.get_world_size()
    grad_norm = clip_and_measure(model, optimizer, grad_clip)
    stepped = True
    if gate is not None:
        # On the device: the guard may all-reduce its verdict (NCCL needs device tensors).
        stepped = gate.allow(step, packed[0], grad_norm.detach())
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if not host_sync:
        metrics_t = {k: packed[j + 1] for j, k in enumerate(names)}
        return StepResult(loss=packed[0], grad_norm=grad_norm, stepped=stepped, metrics=metrics_t)
    host = packed.cpu().tolist()  # one device -> host copy for every scalar
    metrics = dict(zip(names, host[1:]))
    return StepResult(loss=host[0], grad_norm=float(grad_norm), stepped=stepped, metrics=metrics)
