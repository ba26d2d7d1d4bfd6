"""The run's LR schedule: core's schedule on every param group, checkpointed by position only.

``RunSchedule`` puts one ``LambdaLR`` (``loop.lr_schedule``) on each optimizer the stack
names (megatron's inner optimizers, a torch optimizer, ...) and steps them together. Its
checkpoint state is the position alone (the number of updates taken; a skipped step does
not count), so a resumed run follows the schedule of *its own* config from the restored
position: a new ``train.steps`` stretches the decay, a new ``optim.lr`` or
``optim.schedule.*`` takes effect at once. The peak LR of each group is what the stack's
optimizer had when the schedule was built (``optim.lr``, times any per-group factor).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from longboat.core.loop.lr_schedule import build_lr_scheduler


class RunSchedule:
    """One LR schedule over several optimizers (module doc)."""

    def __init__(self, optimizers: list[Any], cfg: Any, total_steps: int) -> None:
        self.schedulers: list[LambdaLR] = [
            build_lr_scheduler(o, cfg, total_steps) for o in optimizers
        ]

    @property
    def position(self) -> int:
        """Updates taken so far (the multiplier's argument for the next update)."""
        return self.schedulers[0].last_epoch if self.schedulers else 0

    def step(self) -> None:
        """Advance after an update was taken."""
        for s in self.schedulers:
            # The update may not have gone through ``optimizer.step()`` (a fused or one-pass
            # update writes the parameters itself): it was taken, so torch's check that the
            # optimizer stepped first must not warn.
            s.optimizer._opt_called = True  # type: ignore[attr-defined]
            s.step()

    def get_last_lr(self) -> float:
        """The LR of the first param group now (every group follows the same multiplier)."""
        return float(self.schedulers[0].get_last_lr()[0]) if self.schedulers else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go to the saved position; the LRs follow this run's schedule there."""
        self.seek(_saved_position(state))

    def seek(self, position: int) -> None:
        """Set every group's LR to the schedule's value after ``position`` updates."""
        for s in self.schedulers:
            s.last_epoch = position
            lrs = [base * fn(position) for base, fn in zip(s.base_lrs, s.lr_lambdas)]
            for group, lr in zip(s.optimizer.param_groups, lrs):
                set_lr(group, lr)
            s._last_lr = lrs  # what get_last_lr() returns, as LambdaLR.step() would set it


class DeviceLRTable:
    """One ``LambdaLR``'s learning rates as device tables, indexed by a device count of the
    updates taken, for a step that must not wait for the host (a CUDA-graphed step, or one
    whose NaN-guard verdict comes a step late): the LR of the update after a skipped one is
    right before the host knows about the skip.

    ``load()`` (before an update, on the device) copies each group's ``table[position]`` into
    its LR tensor; ``advance()`` (after it) adds ``1 - found_inf``. The tables hold
    ``base_lr * lr_lambda(k)`` rounded to fp32 for ``k = 0 .. total_steps``: what the host
    schedule sets at position ``k``. Build it after a resume (it starts at the scheduler's
    position). Both methods are device ops only, so they may run inside a captured graph.
    """

    def __init__(
        self,
        scheduler: LambdaLR,
        lr_tensors: list[torch.Tensor],
        found_inf: torch.Tensor,
        total_steps: int,
    ) -> None:
        if not isinstance(scheduler, LambdaLR):
            raise ValueError(
                "DeviceLRTable needs a LambdaLR (what core's build_lr_scheduler returns) to "
                f"tabulate its LR per step; got {type(scheduler).__name__}. Fix: build the "
                "schedule with longboat.core.loop.build_lr_scheduler"
            )
        if len(lr_tensors) != len(scheduler.base_lrs):
            raise ValueError(
                f"DeviceLRTable: {len(lr_tensors)} LR tensors for {len(scheduler.base_lrs)} "
                "param groups"
            )
        self.lr_tensors = lr_tensors
        self.found_inf = found_inf
        device = found_inf.device
        n = max(total_steps, scheduler.last_epoch) + 1
        self.tables = [
            torch.tensor([base * fn(k) for k in range(n)], dtype=torch.float32, device=device)
            for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)
        ]
        self.position = torch.full((1,), scheduler.last_epoch, dtype=torch.int64, device=device)

    @torch.no_grad()
    def load(self) -> None:
        """Each group's LR for the next update, on the device (no host sync)."""
        for lr, table in zip(self.lr_tensors, self.tables):
            lr.copy_(torch.index_select(table, 0, self.position).reshape(()))

    @torch.no_grad()
    def advance(self) -> None:
        """Count the update just run unless it was skipped (``found_inf``), on the device."""
        self.position.add_(1).sub_(self.found_inf.reshape(()).to(torch.int64))


def set_lr(group: dict[str, Any], lr: float) -> None:
    """Write ``lr`` into a param group (in place where it is a tensor a CUDA graph reads)."""
    current = group.get("lr")
    if isinstance(current, torch.Tensor):
        current.fill_(lr)
    else:
        group["lr"] = lr


def _saved_position(state: dict[str, Any]) -> int:
    """The position from this class's state or from a plain / chained ``LambdaLR`` state."""
    if "position" in state:
        return int(state["position"])
    if "last_epoch" in state:
        return int(state["last_epoch"])
    if state.get("schedulers"):
        return int(state["schedulers"][0]["last_epoch"])
    raise ValueError(f"not an LR schedule state: keys {sorted(state)}")


__all__ = ["DeviceLRTable", "RunSchedule", "set_lr"]
