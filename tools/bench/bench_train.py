"""The longboat side of every benchmark: what the command line runs.

``compose`` is the CLI's config (``compose_experiment``) plus the benchmark's overrides;
``train_timed`` hands it to the stack's ``build_training`` and core's ``Trainer`` with a
``StepTimer``. A run writes nothing it does not need (a temporary run directory; no progress bar,
TensorBoard, checkpoint or export) and logs once, after the last (untimed) step, since a log line
synchronises the device.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench_env import free_memory
from bench_profile import ProfileCallback
from bench_timing import StepTimer

QUIET = (
    "logging.progress=false",
    "logging.trackers=[]",
    "checkpoint.save_on_exit=false",
    "checkpoint.resume=none",
    "checkpoint.every_steps=0",
)
EXPORT_OFF = {
    "llm": "export.enabled=false",
    "vlm": "export.enabled=false",
    "embodied": "export.enabled=false",
    "diffusion": "export.enabled=false",
}


def compose(stack: str, experiment: str, overrides: Sequence[str], output_dir: str) -> Any:
    """The typed config of ``longboat-<stack> train experiment=<experiment> <overrides>``."""
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import typed_config

    extra = [f"output_dir={output_dir}", *QUIET, EXPORT_OFF[stack]]
    return typed_config(compose_experiment(experiment, [*overrides, *extra], stack=stack))


def build_training(stack: str) -> Callable[[Any], Any]:
    """The stack's assembly: ``longboat.<stack>.train.training.build_training``."""
    return importlib.import_module(f"longboat.{stack}.train.training").build_training


def model_overrides(values: dict[str, Any]) -> list[str]:
    """``model.overrides`` (embodied: dotted family-config keys) as one override string."""
    if not values:
        return []
    items = ",".join(f"{k}:{_hydra(v)}" for k, v in values.items())
    return [f"model.overrides={{{items}}}"]


def _hydra(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list | tuple):
        return "[" + ",".join(_hydra(x) for x in v) + "]"
    return str(v)


def train_timed(
    stack: str,
    experiment: str,
    overrides: Sequence[str],
    acc: Any,
    *,
    warmup: int,
    steps: int,
    profile_steps: int = 0,
    profile_out: Path | None = None,
    profile_parts: tuple[str, ...] = (),
    prepare: Callable[[Any], None] | None = None,
    feed: Callable[[Any], Callable[[int], Iterator[Any]]] | None = None,
    probe: Callable[[Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``build_training(compose(...))`` run by ``Trainer`` for ``warmup + steps + 1`` steps (steps
    ``warmup+1 .. warmup+steps`` timed), plus ``profile_steps`` profiled ones into ``profile_out``
    (with the forward + backward time of the ``record_function`` ranges ``profile_parts``).
    ``prepare(training)`` runs after the build (the loss alignments take the weights there);
    ``feed(training)``, if given, is the run's input (``start_step -> iterator``) in place of
    ``training.batches`` (core's ``FedTraining``; the loss alignments' fixed batches);
    ``probe(training)`` runs after the run (its dict joins the result). The wait for each
    batch is timed by feeding the run its own input through ``StepTimer.timed_batches``. Returns the ``Timing``, losses,
    peak memory, build time, ``items_per_step`` and ``notes`` (the trainer's output, the profile)."""
    from longboat.core.train import Trainer
    from longboat.core.train.training import FedTraining

    warmup = max(1, warmup)
    profile_steps = profile_steps if profile_out is not None else 0
    total = warmup + steps + profile_steps + 1
    timer = StepTimer(acc, warmup, steps)
    callbacks = [timer]
    if profile_steps:
        callbacks.append(
            ProfileCallback(acc, warmup + steps, profile_steps, profile_out, parts=profile_parts)
        )
    with tempfile.TemporaryDirectory(prefix="longboat_bench_") as out_dir:
        leftover = free_memory(acc)
        t0 = time.perf_counter()
        steps_keys = [f"train.steps={total}", f"train.log_every={total}"]
        cfg = compose(stack, experiment, [*overrides, *steps_keys], out_dir)
        training = build_training(stack)(cfg)
        try:
            build_s = time.perf_counter() - t0
            if prepare is not None:
                prepare(training)
            source = training.batches if feed is None else feed(training)
            timed = FedTraining(training, lambda start: timer.timed_batches(iter(source(start))))
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                run = Trainer(cfg, timed, callbacks=callbacks).fit()
            extra = probe(training) if probe is not None else {}
        finally:
            training.close()
    # what the run printed, less the paths of its (deleted) run directory
    lines = [ln for ln in printed.getvalue().splitlines() if ln.strip() and out_dir not in ln]
    notes: dict[str, Any] = {"trainer": lines}
    if profile_steps and callbacks[-1].summary:
        notes["profile"] = callbacks[-1].summary
    return {
        "timing": timer.timing,
        "losses": run.losses,
        "peak_mem_gb": acc.memory_stats().get("peak_allocated_gb", 0.0),
        "build_s": build_s,
        "items_per_step": training.items_per_step,
        "allocated_at_start_gb": leftover,
        "notes": notes,
        **extra,
    }
