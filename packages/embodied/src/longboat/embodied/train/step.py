"""One optimizer step over gradient-accumulated micro-batches, identical at any world size.

Every micro-batch of a global batch has a global index ``m`` (0..dp*accum-1):
rank ``r`` runs micro-batches ``r*accum .. r*accum+accum-1``. Before each one, the
RNG (flow-matching noise and time, dropout) is re-seeded from (seed, step, m), so
world size 1 with accumulation N and world size N without accumulation compute
the same losses and, up to summation order, the same gradients. The same seeding
makes a resumed run reproduce the uninterrupted one regardless of RNG history.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from longboat.embodied.parallel.optim import clip_grad_norm_

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
    """What one optimizer step measured."""

    loss: float
    """Mean loss over every micro-batch of the global batch (all ranks)."""
    grad_norm: float
    """Global grad norm before clipping."""
    stepped: bool
    """False when the NaN guard skipped the update."""
    metrics: dict[str, float]
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
    should_step: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
    scheduler: Any = None,
) -> StepResult:
    """Forward/backward ``micro_batches`` (this rank's share), then one optimizer step.

    ``rank_offset`` is the global index of this rank's first micro-batch
    (``dp_rank * accum``); ``device_index`` is this process's device (None on CPU).
    ``model(batch)`` must return a dict with a scalar
    ``loss``; other scalar entries are averaged and reported. ``should_step``
    (the NaN guard) sees the global loss and grad norm and may veto the update.
    """
    accum = len(micro_batches)
    dtype = _DTYPES.get(precision)
    trainable = [p for p in model.parameters() if p.requires_grad]
    total_loss = torch.zeros((), dtype=torch.float64)
    extras: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(micro_batches):
        last = i == accum - 1
        _set_fsdp_sync(model, last)
        autocast = (
            torch.autocast(device_type=device_type, dtype=dtype)
            if dtype is not None
            else contextlib.nullcontext()
        )
        with (
            _no_sync(model, last),
            seeded_rng(micro_batch_seed(seed, step, rank_offset + i), device_type, device_index),
        ):
            with autocast:
                out = model(batch)
            loss = out["loss"]
            (loss / accum).backward()
        total_loss += loss.detach().double().cpu()
        for key, value in out.items():
            if key != "loss" and isinstance(value, torch.Tensor) and value.numel() == 1:
                extras[key] = extras.get(key, 0.0) + value.detach().double().cpu()
    names = sorted(extras)
    packed = torch.stack([total_loss] + [torch.as_tensor(extras[k]) for k in names]) / accum
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # gloo reduces CPU tensors (and has no AVG); NCCL needs them on the device.
        reduce_on = packed if device_type == "cpu" else packed.to(device_type)
        dist.all_reduce(reduce_on, op=dist.ReduceOp.SUM)
        packed = reduce_on.cpu() / dist.get_world_size()
    grad_norm = clip_grad_norm_(trainable, grad_clip)
    loss_value = float(packed[0])
    stepped = True
    if should_step is not None:
        # On the device: the guard may all-reduce its verdict (NCCL needs device tensors).
        on = torch.device(device_type) if device_type != "cpu" else torch.device("cpu")
        stepped = should_step(torch.tensor(loss_value, device=on), grad_norm.detach().to(on))
    if stepped:
        optimizer.step()
        if scheduler is not None:  # a skipped step does not advance the schedule either
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = {k: float(v) for k, v in zip(names, packed[1:].tolist())}
    return StepResult(loss=loss_value, grad_norm=float(grad_norm), stepped=stepped, metrics=metrics)
