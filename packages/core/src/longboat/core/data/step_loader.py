"""Every step's batch, built ahead of the training loop by loader processes.

With a global batch plan the data of step ``s`` is a pure function of ``s``; a stack gives
``build(step)`` (its rank's micro-batches of that step) and :func:`step_batches` yields
``build(start), build(start + 1), ...`` in order, built by ``num_workers`` loader processes
(0: on the training thread). Nothing is saved with a checkpoint: a resumed run starts
again at its step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["step_batches"]


class _Steps(torch.utils.data.Dataset):
    """Item ``k``: ``build(start + k)``."""

    def __init__(self, build: Callable[[int], Any], start: int) -> None:
        self.build, self.start = build, start

    def __len__(self) -> int:
        return 2**40  # the trainer stops taking steps; the loader never runs dry

    def __getitem__(self, k: int) -> Any:
        return self.build(self.start + k)


def _as_is(item: Any) -> Any:
    return item


def step_batches(
    build: Callable[[int], Any], start_step: int, *, num_workers: int, pin_memory: bool = False
) -> Iterator[Any]:
    """``build(step)`` of every step from ``start_step`` on, in order; ``num_workers`` loader
    processes (which ignore SIGINT: the trainer handles Ctrl-C) build two steps ahead each,
    and ``pin_memory`` pins the tensors for asynchronous copies to the device."""
    from longboat.core.loop.signals import ignore_sigint

    loader = torch.utils.data.DataLoader(
        _Steps(build, start_step),
        batch_size=None,
        num_workers=num_workers,
        collate_fn=_as_is,
        pin_memory=pin_memory,
        prefetch_factor=2 if num_workers else None,
        worker_init_fn=ignore_sigint if num_workers else None,
    )
    yield from loader
