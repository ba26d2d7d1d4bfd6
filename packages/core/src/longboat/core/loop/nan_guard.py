"""Skip optimizer steps whose loss or grad norm is NaN/inf; abort after N in a row.

``NaNGuard.check`` decides synchronously (it reads the loss on the host, a device sync per
step). ``DeferredNaNGuard`` is its host half for steps that already skip on the device: it
stages each step's loss and grad norm to the host without waiting and judges a step only
once the next one has been queued, so the host never waits for more than the previous step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from longboat.core.config.schema import NaNGuardConfig
from longboat.core.errors import UserError


class NonFiniteLossError(UserError, RuntimeError):
    """Too many consecutive non-finite steps: the run is diverging."""

    exit_code = 1


def _is_finite(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value.detach()).all())
    return math.isfinite(float(value))


class NaNGuard:
    """Decides per step whether to apply the optimizer update.

    ``check()`` returns False for a non-finite loss or grad norm (skip the step:
    zero the grads, don't step the optimizer or the LR schedule), counts it, and
    raises ``NonFiniteLossError`` when ``max_consecutive`` happen in a row. A
    finite step resets the run of failures. With ``sync_ranks`` (default) the
    verdict is all-reduced, so every rank skips the same steps.
    """

    def __init__(self, cfg: NaNGuardConfig, *, sync_ranks: bool = True) -> None:
        if cfg.max_consecutive < 1:
            raise ValueError(
                f"train.nan_guard.max_consecutive={cfg.max_consecutive} must be >= 1. "
                "Fix: set it to a positive count (or train.nan_guard.enabled=false)."
            )
        self.cfg = cfg
        self.sync_ranks = sync_ranks
        self.consecutive = 0
        """Non-finite steps in the current run of failures."""
        self.total_skipped = 0
        """Non-finite steps skipped since the start of training."""

    def check(self, loss: Any, grad_norm: Any = None) -> bool:
        """True = take the step; False = skip it. Raises after too many skips in a row."""
        if not self.cfg.enabled:
            return True
        bad = not (_is_finite(loss) and _is_finite(grad_norm))
        bad = self._any_rank(bad, loss)
        return self._count(bad, loss, grad_norm)

    def check_global(self, loss: float, grad_norm: float | None = None, *, step: int) -> bool:
        """``check`` for host values that are the same on every rank already (a loss averaged
        over ranks, the norm of all-reduced grads): no collective. ``step`` (0-based) is
        named in the abort message."""
        if not self.cfg.enabled:
            return True
        bad = not (math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)))
        return self._count(bad, loss, grad_norm, step=step)

    def _count(self, bad: bool, loss: Any, grad_norm: Any, step: int | None = None) -> bool:
        if not bad:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.total_skipped += 1
        if self.consecutive >= self.cfg.max_consecutive:
            at = "" if step is None else f" at step {step + 1}"
            raise NonFiniteLossError(
                f"{self.consecutive} consecutive steps had a non-finite loss or grad norm "
                f"(last loss={_show(loss)}, grad_norm={_show(grad_norm)}{at}; "
                f"{self.total_skipped} skipped in total), reaching "
                f"train.nan_guard.max_consecutive={self.cfg.max_consecutive}. "
                "Fix: lower optim.lr, raise optim.schedule.warmup_steps, check the data, "
                "or raise train.nan_guard.max_consecutive."
            )
        return False

    def _any_rank(self, bad: bool, loss: Any) -> bool:
        if not (self.sync_ranks and dist.is_available() and dist.is_initialized()):
            return bad
        if dist.get_world_size() == 1:
            return bad
        device = loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu")
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def state_dict(self) -> dict[str, int]:
        """Counters to checkpoint."""
        return {"consecutive": self.consecutive, "total_skipped": self.total_skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore counters saved by ``state_dict``."""
        self.consecutive = int(state["consecutive"])
        self.total_skipped = int(state["total_skipped"])


@dataclass(frozen=True)
class Verdict:
    """The guard's decision on one step, as ``DeferredNaNGuard`` resolved it."""

    step: int
    """0-based step index (as passed to ``submit``)."""
    loss: float
    grad_norm: float | None
    stepped: bool
    """False when the step was skipped (non-finite loss or grad norm, guard enabled)."""


class DeferredNaNGuard:
    """``NaNGuard``'s host side one step late, for steps whose skip is decided on the device.

    The caller's step must already skip its own update (and whatever else a skip must not
    advance) on the device when the loss or grad norm is non-finite; this class only does the
    guard's counting, the abort and tells the caller which steps were skipped (for the host
    LR schedule). Per step:

    - ``submit(step, loss, grad_norm)`` queues a non-blocking device -> host copy of the two
      values (pinned memory on CUDA) and records an event after it: no wait;
    - ``resolve(keep=1)`` then judges every staged step but the newest ``keep``: it waits on
      each one's event (the copy, i.e. that step, is done) and runs ``NaNGuard.check_global``
      on the host values. Called right after ``submit(n)``, it waits for step n-1 at most,
      while step n is already queued on the device;
    - ``resolve()`` (``keep=0``) before anything that needs exact counters or the host LR
      schedule: a checkpoint, an eval, the end of training, an interruption, a log line.

    The values must be the same on every rank (``check_global``: no collective), as the
    global loss and grad norm of a data-parallel step are. ``NonFiniteLossError`` is raised
    from ``resolve``: when ``max_consecutive`` is reached at step n, the caller has already
    queued step n+1 (the abort comes at most one step later than ``NaNGuard.check``'s; the
    extra step is itself guarded on the device). ``reads`` counts the staged values read.
    """

    def __init__(self, guard: NaNGuard, accelerator: Any = None) -> None:
        self.guard = guard
        self.accelerator = accelerator
        self._staged: deque[tuple[int, torch.Tensor, Any]] = deque()
        self.reads = 0
        """Staged steps read on the host so far (each after its event completed)."""

    @property
    def pending(self) -> list[int]:
        """Steps submitted but not yet resolved, oldest first."""
        return [step for step, _, _ in self._staged]

    def submit(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Stage step ``step``'s (0-dim, device) loss and grad norm; returns at once."""
        device = loss.device
        values = torch.stack(
            [loss.detach().reshape(()).double(), grad_norm.detach().reshape(()).double().to(device)]
        )
        # Non-blocking device -> host copies land in pinned memory (no-op on CPU tensors).
        host = values.to("cpu", non_blocking=True)
        event = None
        if self.accelerator is not None:  # host-only accelerators give a no-op HostEvent
            event = self.accelerator.event()
            event.record()
        self._staged.append((step, host, event))

    def resolve(self, keep: int = 0) -> list[Verdict]:
        """Judge every staged step but the newest ``keep``, oldest first (waiting for each);
        raises ``NonFiniteLossError`` as ``NaNGuard.check`` does."""
        verdicts = []
        while len(self._staged) > keep:
            step, host, event = self._staged.popleft()
            loss, grad_norm = self._read_staged(host, event)
            stepped = self.guard.check_global(loss, grad_norm, step=step)
            verdicts.append(Verdict(step, loss, grad_norm, stepped))
        return verdicts

    def _read_staged(self, host: torch.Tensor, event: Any) -> list[float]:
        """The one host read of a staged step (tests allow reads from here only)."""
        if event is not None:
            event.synchronize()
        self.reads += 1
        return host.tolist()


def _show(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return str(value.item())
    return str(value)
