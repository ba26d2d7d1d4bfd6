"""The phases of the scaling benchmarks (llm_scaling, vla_scaling), each in its own processes.

``run_phases`` runs each ``(name, world)`` phase as ``world`` processes through core's
``run_multiprocess``, with torchrun's variables and the process group set up first, so the
stack's ``build_training`` joins that group (gloo and forked workers on CPU; NCCL and spawned
workers on GPUs, where no CUDA state may be inherited). A phase is skipped when less than 1.3 x
the last phase's time is left of the budget; a failed phase is recorded; the results are
rewritten after each phase.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def preflight(parser: argparse.ArgumentParser, args: argparse.Namespace, module: str) -> None:
    """A scaling run's checks: somewhere to write, two CUDA devices or ``--tiny`` (then gloo
    workers forked from this process, which imports ``module``, the stack, once for them)."""
    if args.out is None and args.results_dir is None:
        parser.error("give --out and/or --results-dir (where the results go)")
    if not args.tiny and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        parser.error("needs 2 CUDA devices (use --tiny for the CPU smoke)")
    if args.tiny:
        os.environ["LONGBOAT_ACCELERATOR"] = "cpu"
        torch.set_num_threads(1)  # no OpenMP pool for the forked workers to inherit
        importlib.import_module(module)


def run_phases(
    phases: list[tuple[str, int]],
    fn: Callable[..., dict[str, Any]],
    extra: tuple[Any, ...],
    summarize: Callable[[str, int, list[dict[str, Any]]], dict[str, Any]],
    result: dict[str, Any],
    write: Callable[[], None],
    *,
    cpu: bool,
    time_budget: float,
    t_start: float,
    phase_s: float,
) -> None:
    """``fn(rank, world, name, *extra)`` on every rank of each phase, ``summarize(name, world,
    per_rank)`` into ``result["runs"]``; ``phase_s``: a phase's assumed time before one ran."""
    from longboat.core.distributed.multiprocess import run_multiprocess

    last: float | None = None
    for name, world in phases:
        left = time_budget - (time.time() - t_start) if time_budget else 3600.0
        if time_budget and left < 1.3 * (last or phase_s):
            result["skipped"].append(f"{name}: skipped: time budget ({left:.0f}s left)")
            print(f"== {name}: skipped ({left:.0f}s left)", flush=True)
            continue
        print(f"== {name} ({world} process(es))", flush=True)
        t0 = time.time()
        try:
            per_rank = run_multiprocess(
                fn, world, name, *extra, backend="gloo" if cpu else "nccl", timeout=left,
                start_method="fork" if cpu else "spawn",
            )  # fmt: skip
            entry = summarize(name, world, per_rank)
        except Exception as exc:
            traceback.print_exc()
            entry = {"name": name, "gpus": world, "error": f"{type(exc).__name__}: {exc}"}
            result["errors"].append(f"{name}: {entry['error'][-2000:]}")
            print(entry["error"], flush=True)
        last = time.time() - t0
        result["runs"].append(entry)
        result["wall_s"] = time.time() - t_start
        write()
