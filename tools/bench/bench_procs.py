"""One-worker-per-device plumbing shared by the scaling benchmarks (llm_scaling, vla_scaling).

The parent spawns ``nprocs`` workers, each ``worker(rank, nprocs, decisions, barrier, *extra)``,
and kills them at the time budget (+ 15 s of grace); the workers walk the same list of phases,
rank 0 decides for all of them whether a phase runs (``agree``: a decision passed through a
queue, so every rank takes the same branch and none waits in a collective alone), and
``gather`` collects a value from every rank of a phase's process group.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def agree[T](rank: int, nprocs: int, decisions: Any, decide: Callable[[], T], timeout: float) -> T:
    """Rank 0 runs ``decide()`` and hands the result to every other rank; all return it."""
    if rank == 0:
        decision = decide()
        for _ in range(nprocs - 1):
            decisions.put(decision)
        return decision
    return decisions.get(timeout=timeout)


def gather(obj: Any) -> list[Any]:
    """``obj`` of every rank of the live process group (rank order)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_workers(
    worker: Callable[..., None],
    nprocs: int,
    extra: tuple[Any, ...],
    *,
    time_budget: float,
    t_start: float,
) -> tuple[list[int | None], list[int]]:
    """Spawn the workers (``spawn`` start method) and wait for them, killing those still
    running 15 s after the budget (``time_budget`` seconds from ``t_start``; 0: no limit).
    Returns (exit codes, killed ranks)."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    decisions = ctx.Queue()
    barrier = ctx.Barrier(nprocs)
    procs = [
        ctx.Process(target=worker, args=(rank, nprocs, decisions, barrier, *extra))
        for rank in range(nprocs)
    ]
    for proc in procs:
        proc.start()
    deadline = t_start + time_budget + 15 if time_budget else math.inf
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.time()) if time_budget else None)
    killed = [i for i, proc in enumerate(procs) if proc.is_alive()]
    for i in killed:
        procs[i].kill()  # our own worker, by handle
        procs[i].join()
    return [proc.exitcode for proc in procs], killed


def report_failure(
    codes: list[int | None], killed: list[int], written: Path | None, table: Callable
) -> bool:
    """Print what went wrong (and the partial results file's table, written after the last
    finished phase); True when a worker failed or was killed."""
    if not killed and all(code == 0 for code in codes):
        return False
    print(
        f"workers ended with exit codes {codes}"
        + (f" (ranks {killed} killed at the time budget)" if killed else ""),
        flush=True,
    )
    if written is not None and written.is_file():
        print("partial results (written after the last finished phase):")
        print(table(json.loads(written.read_text())), flush=True)
    return True
