"""Skip optimizer steps whose loss or grad norm is NaN/inf; abort after N in a row."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from longboat.core.config.schema import NaNGuardConfig


class NonFiniteLossError(RuntimeError):
    """Too many consecutive non-finite steps: the run is diverging."""


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
        if not bad:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.total_skipped += 1
        if self.consecutive >= self.cfg.max_consecutive:
            raise NonFiniteLossError(
                f"{self.consecutive} consecutive steps had a non-finite loss or grad norm "
                f"(last loss={_show(loss)}, grad_norm={_show(grad_norm)}; "
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


def _show(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return str(value.item())
    return str(value)
