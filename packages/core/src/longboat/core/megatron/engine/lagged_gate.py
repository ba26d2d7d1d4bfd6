"""The step engine's NaN gate without a host read of the loss every step.

The synchronous guard (core's ``NaNGuard.check``) reads each step's loss on the host before
deciding whether to run the optimizer step: a full device sync per step, so the host cannot
queue step n+1 while the device runs step n. ``LaggedLossGuard`` keeps the guard's numbers
and moves the decision:

- on the device: the inner torch AdamW of megatron's optimizer runs fused (``fused=True``; on
  CPU too, where torch has a fused AdamW) and reads its ``found_inf`` attribute, which is set
  to ``not isfinite(loss)`` of the step on the device before the update. torch's fused AdamW
  skips the update of every parameter and moment and takes the step count back when it is 1
  (torch's foreach and for-loop AdamW refuse ``found_inf``, hence fused). megatron's
  ``prepare_grads`` / ``step_with_ready_grads`` change nothing else a skipped step must keep:
  the grad copy into the main grads is rewritten every step, and the main -> model param copy
  (and the param all-gather at DP>1) copies the unchanged main weights;
- on the host, one step late: core's ``DeferredNaNGuard`` stages the loss of step n without
  waiting, and step n-1's verdict is resolved after step n's forward/backward is queued and
  before its update is, so the host waits at most for step n-1's forward/backward (the
  device still has step n-1's update and step n's forward/backward queued). The verdict
  steps the host LR schedule (core's ``RunSchedule``) only for a step that was not skipped, before
  step n's update reads the LR: the LR of every update is the synchronous guard's Python
  float, bit for bit, with no device LR table. The counters and the abort are the guard's:
  ``NonFiniteLossError`` for step n comes while step n+1 runs, before its update is queued
  (one forward/backward later than the synchronous guard; the weights at the abort are the
  same).

``flush()`` resolves the last pending verdict (core's trainer calls it before a log line, an
eval, a checkpoint, an exact callback, the end and after an interruption: those read the
counters or the LR schedule). The guard judges the loss only, as the loop's synchronous
guard does (the grad norm is not computed without clipping), so the staged grad norm is a
constant 0.

With the one-pass update (``engine.one_pass_adamw``) the update is
``OnePassAdamW.step(found_inf=...)`` instead, which skips on the device itself and clips on
the device (no ``.item()`` of the grad norm), so there gradient clipping keeps the lagged
guard too.

``lagged_guard_blocker`` says where this does not apply; the loop keeps the synchronous guard
there: gradient clipping through megatron's step (its ``step()`` reads the grad norm on the
host anyway) and fp16 loss scaling (its ``step()`` reads ``found_inf`` on the host),
``optim.fused=false``, an inner optimizer other than torch's Adam / AdamW, or parameters
fused AdamW cannot update.
"""

from __future__ import annotations

from typing import Any

import torch

from longboat.core.engine.device_skip import (
    install_found_inf,
    mark_non_finite,
    remove_found_inf,
    use_fused_adamw,
)
from longboat.core.loop.nan_guard import NaNGuard
from longboat.core.megatron.optimizer import inner_optimizers
from longboat.core.train.gate import LaggedUpdateGate


def lagged_guard_blocker(
    optimizer: Any, guard_cfg: Any, *, one_pass: Any = None, fused: bool = True
) -> str | None:
    """None when the loop can take ``LaggedLossGuard`` with ``optimizer`` (megatron's, chained
    or not; ``one_pass``: the loop's ``OnePassAdamW``, if any), else why not (the loop then
    reads the loss every step: the synchronous guard)."""
    if not guard_cfg.enabled:
        return "train.nan_guard.enabled=false: no guard"
    if one_pass is not None:
        if one_pass.handles():
            return None  # it skips (and clips) on the device itself
        return "optim.one_pass_adamw cannot take this step: fp16 loss scaling or mixed groups"
    parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    if any(float(getattr(p.config, "clip_grad", 0.0) or 0.0) > 0.0 for p in parts):
        return "optim.grad_clip > 0: megatron's step() reads the grad norm on the host"
    if any(getattr(p, "grad_scaler", None) is not None for p in parts):
        return "fp16 loss scaling: megatron's step() reads found_inf on the host"
    if not fused:
        return "optim.fused=false: only torch's fused AdamW skips an update on found_inf"
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    for inner in inner_optimizers(optimizer):
        if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
            return f"the inner optimizer is {type(inner).__name__}, not torch's Adam / AdamW"
        for group in inner.param_groups:
            if group.get("differentiable"):
                return "a differentiable AdamW param group"
            for p in group["params"]:
                if p.device.type not in devices or not p.is_floating_point():
                    return (
                        f"a {p.dtype} parameter on {p.device.type} (fused AdamW cannot update it)"
                    )
    return None


class LaggedLossGuard(LaggedUpdateGate):
    """The update gate with the skip on the device and the host side one step late (module
    doc). Per step n: ``forward_backward``, then ``allow(n, loss)`` (sets ``found_inf`` on the
    device, stages the loss, resolves step n-1), then the optimizer update. Build it after a
    resume (it switches the param groups to fused AdamW, which a loaded checkpoint's param
    groups would otherwise overwrite)."""

    def __init__(
        self,
        guard: NaNGuard,
        schedule: Any,
        optimizer: Any,
        accelerator: Any = None,
        *,
        one_pass: bool = False,
    ) -> None:
        super().__init__(guard, schedule, accelerator)
        self.inners = inner_optimizers(optimizer)
        self.found_inf = device_found_inf(optimizer)
        """1.0 when the step being updated has a non-finite loss (torch's fused AdamW then
        skips it), else 0.0; written on the device by ``allow``."""
        if not one_pass:  # one-pass: passed to its step
            install_found_inf(self.inners, self.found_inf)

    @torch.no_grad()
    def allow(self, step: int, loss: torch.Tensor, grad_norm: Any = None) -> bool:
        """Set up step ``step``'s update to skip on a non-finite ``loss`` (device op), stage the
        loss and resolve the previous step's verdict (stepping the LR schedule for it unless it
        was skipped); True (the device decides)."""
        mark_non_finite(self.found_inf, loss)
        self.stage(step, loss)
        return True

    def close(self) -> None:
        """Take ``found_inf`` off the inner optimizers (a later plain ``step()`` steps)."""
        remove_found_inf(self.inners, self.found_inf)


def device_found_inf(optimizer: Any) -> torch.Tensor:
    """A 0-d fp32 zero on the device of the optimizer's parameters (a skip flag)."""
    params = [p for o in inner_optimizers(optimizer) for g in o.param_groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    return torch.zeros((), dtype=torch.float32, device=device)


__all__ = [
    "LaggedLossGuard",
    "device_found_inf",
    "install_found_inf",
    "lagged_guard_blocker",
    "mark_non_finite",
    "remove_found_inf",
    "use_fused_adamw",
]
