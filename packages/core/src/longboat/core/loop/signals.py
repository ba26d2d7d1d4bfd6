"""SIGTERM / SIGUSR1 -> finish the step, save a checkpoint and exit cleanly.

Schedulers (Slurm, Kubernetes) send SIGTERM, or SIGUSR1 ahead of the time
limit (``--signal=USR1@120``). The handler only sets a flag; the training loop
polls ``should_stop()`` once per step, so the checkpoint is written at a step
boundary. A second identical signal falls back to the previous handler
(forcing an exit when a save hangs).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Signals that request a graceful stop."""


class GracefulShutdown:
    """Context manager that turns stop signals into ``requested`` / ``should_stop()``."""

    def __init__(self, signals: tuple[signal.Signals, ...] = DEFAULT_SIGNALS) -> None:
        self.signals = signals
        self.requested = False
        """A stop signal reached this process."""
        self.signal_name: str | None = None
        """Name of the first signal received (e.g. ``SIGTERM``)."""
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == getattr(signal, self.signal_name or "", None):
            # Second time: the user or scheduler insists, so behave as without us.
            previous = self._previous.get(signum, signal.SIG_DFL)
            signal.signal(signum, previous)
            if callable(previous):
                previous(signum, frame)
            else:
                os.kill(os.getpid(), signum)
            return
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
        self.requested = True

    def __enter__(self) -> GracefulShutdown:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("GracefulShutdown must be entered in the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def should_stop(self) -> bool:
        """True if any rank received a stop signal (a collective: call it on every rank)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.requested
        device = torch.device("cpu")
        if dist.get_backend() != "gloo":
            from longboat.core.device import get_accelerator

            device = get_accelerator().device()
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and not self.requested:
            self.requested = True
            self.signal_name = "peer"
        return self.requested


def ignore_sigint(worker_id: int) -> None:
    """``worker_init_fn`` of a training loop's DataLoader: its workers ignore SIGINT.

    A terminal's Ctrl-C reaches every process of the foreground group: the trainer takes it
    as "stop at the step boundary and save", but a worker would die of it (KeyboardInterrupt)
    and the step waiting for its batch would fail instead. The main process still stops the
    workers when it ends (a second Ctrl-C there exits at once)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
