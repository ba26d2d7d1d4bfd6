"""The training loop every stack runs: ``Trainer(cfg, training).fit()``.

The stack builds its run (``Training``: model, optimizer, data, step); the trainer owns
everything around the steps, the same in every stack:

- resume (``checkpoint.resume``: ``auto`` with fallback past a damaged checkpoint, ``none``
  which sets the previous run aside, or a path), with the config winning over the checkpoint
  for hyperparameters and the LR schedule, and the changed keys announced;
- SIGTERM / SIGUSR1 / Ctrl-C: finish the step, save (``checkpoint.save_on_exit``), stop;
- rank failures (``RankWatchdog``): a rank that dies or hangs stops every rank within
  ``train.collective_timeout_s``, named in one line; a step without progress for many median
  step times is reported with the rank's Python stacks;
- the progress bar, metrics (JSONL and the ``logging.trackers``: TensorBoard, W&B, MLflow,
  one row per step even after a resume; the trackers get the config, the final metrics,
  and are closed also when the run fails),
  the NaN guard through the step's update gate (synchronous or one step late), the LR
  schedule, checkpoint cadence and keep-last-N, periodic eval, the profiler window, the
  final export, ``config.yaml`` and ``loss_curve.png`` beside the metrics.

The loop reads nothing on the host per step unless the gate or a callback needs it: the
losses stay on the device until a log line, an eval, a checkpoint or the end.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from longboat.core.checkpoint import CheckpointError, CheckpointManager
from longboat.core.distributed.init import set_collective_timeout
from longboat.core.distributed.watchdog import RankWatchdog
from longboat.core.errors import UserError
from longboat.core.loop import trackers
from longboat.core.loop.metrics import MetricsSink
from longboat.core.loop.nan_guard import NaNGuard
from longboat.core.loop.profiler import StepProfiler
from longboat.core.loop.progress import TrainProgress
from longboat.core.loop.signals import GracefulShutdown
from longboat.core.rng import RNGState
from longboat.core.train import rundir
from longboat.core.train.resume import (
    Hyperparameters,
    changed_keys,
    check_precision_resume,
    check_resume_keys,
    describe_changes,
)
from longboat.core.train.schedule import RunSchedule
from longboat.core.train.training import StepOutput, Training

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""Signals that stop a run at the next step boundary (a second one of the same kind acts as
it would without the trainer)."""


@dataclass
class RunResult:
    """What a run did (the command line prints it; tests and benchmarks read it)."""

    start_step: int = 0
    """Step the run started from (> 0 after a resume)."""
    end_step: int = 0
    """Last completed step."""
    losses: list[float] = field(default_factory=list)
    """Training loss of every step this run took."""
    eval: dict[int, dict[str, float]] = field(default_factory=dict)
    """Held-out metrics by step (the start and the end included)."""
    resumed_from: Path | None = None
    """The checkpoint the run resumed from."""
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Config keys that differ from the resumed checkpoint's: key -> (old, new)."""
    stopped_by_signal: str | None = None
    """Name of the signal that stopped the run early (``SIGTERM``, ``SIGINT``, ``peer``)."""
    checkpoint: Path | None = None
    """The newest checkpoint after the run (rank 0)."""
    metrics_path: Path | None = None
    plot_path: Path | None = None
    """``loss_curve.png`` (None without matplotlib)."""
    export_dir: Path | None = None
    """Where the stack exported the trained model (None: interrupted or export off)."""
    elapsed_s: float = 0.0
    """Wall time of this run's steps."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Stack-specific results (e.g. the LLM's greedy generation)."""

    @property
    def exit_code(self) -> int:
        """The command line's exit status: 130 after Ctrl-C (as a shell reports it), else 0."""
        return 130 if self.stopped_by_signal == "SIGINT" else 0


class Callback:
    """A hook into ``Trainer.fit`` (benchmarks time steps with one, tests stop a run)."""

    exact: bool = False
    """True: the gate's verdicts are resolved and the loss read before each ``on_step_end``
    (a host sync per step); False: called right after the step is queued."""

    def on_step_end(self, trainer: Trainer, step: int, out: StepOutput) -> None:
        """After step ``step`` (1-based: steps completed) was run."""


class _OnStep(Callback):
    exact = True

    def __init__(self, fn: Callable[[int], None]) -> None:
        self.fn = fn

    def on_step_end(self, trainer: Trainer, step: int, out: StepOutput) -> None:
        self.fn(step)


class StepWindow:
    """Wall time of the steps since the last log line, paused around saves and evals."""

    def __init__(self) -> None:
        self.steps = 0
        self._elapsed = 0.0
        self._t0 = time.perf_counter()

    def pause(self) -> None:
        self._elapsed += time.perf_counter() - self._t0

    def resume(self) -> None:
        self._t0 = time.perf_counter()

    def take(self) -> float:
        """Mean seconds a step over the window (call with the device synchronised); restarts."""
        self.pause()
        mean = self._elapsed / max(self.steps, 1)
        self.steps, self._elapsed = 0, 0.0
        self.resume()
        return mean


def typed_config(cfg: Any) -> Any:
    """The composed config as dataclass instances (a DictConfig is converted once)."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _host(value: Any) -> Any:
    if callable(value):
        value = value()
    if isinstance(value, torch.Tensor):
        return float(value.detach().double().reshape(()).item())
    return None if value is None else float(value)


class Trainer:
    """Runs a stack's ``Training`` under the config ``cfg`` (module doc)."""

    def __init__(
        self,
        cfg: Any,
        training: Training,
        *,
        callbacks: Iterable[Callback] = (),
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        from rich.console import Console

        self.cfg = typed_config(cfg)
        self.training = training
        self.callbacks = [
            *callbacks,
            *training.callbacks(),
            *([_OnStep(on_step)] if on_step is not None else []),
        ]
        self.console = Console(quiet=not training.is_main, highlight=False, soft_wrap=True)
        self.result = RunResult()
        self.step = 0
        """Steps completed (the checkpoint's ``step``)."""

    # --- the run -------------------------------------------------------------------------

    def fit(self) -> RunResult:
        """Resume, train to ``train.steps`` (or a stop signal), save, export, report."""
        cfg, t, r = self.cfg, self.training, self.result
        self._start_fresh_if_asked()
        self.guard = NaNGuard(cfg.train.nan_guard)
        self.schedule = RunSchedule(t.optimizers(), cfg.optim.schedule, cfg.train.steps)
        self.ckpt = CheckpointManager(cfg.checkpoint, config_dict=cfg)
        self.state = {
            **t.state(),
            "lr_scheduler": self.schedule,
            "nan_guard": self.guard,
            "rng": RNGState(t.accelerator),
            "step": 0,
        }
        self._resume()
        t.after_resume(self.step)
        self.gate = t.make_gate(self.guard, self.schedule)
        run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
        self.metrics = MetricsSink(
            cfg.logging.dir,
            cfg.logging.run_name,
            trackers.make_trackers(cfg.logging, run_dir, start_step=self.step) if t.is_main else (),
            enabled=t.is_main,
            start_step=self.step,
        )
        try:
            self._run()
        except BaseException as exc:  # the trackers' runs end as failed / killed
            interrupted = isinstance(exc, KeyboardInterrupt)
            self.metrics.close(status=trackers.KILLED if interrupted else trackers.FAILED)
            raise
        return r

    def _run(self) -> None:
        """Everything after the metrics sink opened: the start lines, the steps, the end."""
        cfg, t, r = self.cfg, self.training, self.result
        if t.is_main:
            rundir.save_config(cfg, self.metrics.run_dir)
            self.metrics.start(dataclasses.asdict(cfg))
        self._print_start()
        r.eval[self.step] = t.evaluate()
        if self.step == 0 and r.eval[0]:
            self.metrics.log(0, r.eval[0])  # the curve's starting point
        self.last_saved = r.start_step if r.resumed_from is not None else None
        self.logged_step: int | None = None
        t0 = time.perf_counter()
        set_collective_timeout(cfg.train.collective_timeout_s)
        # A rank that dies or hangs stops every rank, named in one line (RankFailure).
        with RankWatchdog.for_run(cfg.train.collective_timeout_s, step=self.step) as self.watchdog:
            try:
                self._loop()
            finally:
                self.gate.close()
            r.elapsed_s = time.perf_counter() - t0
            self.watchdog.steps_done()
            self._finish()

    def _loop(self) -> None:
        """Steps ``start .. train.steps`` (or up to a stop signal)."""
        cfg, t, r, gate = self.cfg, self.training, self.result, self.gate
        total, log_every, eval_every = cfg.train.steps, cfg.train.log_every, cfg.train.eval_every
        exact_callbacks = any(c.exact for c in self.callbacks)
        read_every_step = not gate.lagged and self.guard.cfg.enabled  # already synced
        pending: list[Any] = []  # step losses not yet read on the host
        window = StepWindow()
        first = self.step + 1  # read exactly, so the progress line has a loss from the start
        batches = iter(t.batches(self.step))
        with (
            GracefulShutdown(STOP_SIGNALS) as stop,
            StepProfiler(cfg.train.profiler, self.metrics.run_dir / "profile") as profiler,
            TrainProgress(
                total,
                unit=t.unit,
                enabled=cfg.logging.progress and t.is_main,
                initial_step=self.step,
            ) as progress,
        ):
            while self.step < total:
                profiler.step(self.step + 1)  # steps are numbered from 1, as in the metrics
                # Named host ranges for torch.profiler traces (where the device waits).
                with record_function("longboat: next batch"):
                    batch = next(batches)
                with record_function("longboat: step"):
                    out = t.step(self.step, batch, gate)
                    gate.end_step()
                self.step = step = self.step + 1
                self.state["step"] = step
                self.watchdog.progress(step)
                pending.append(out.loss)
                window.steps += 1
                log_now = step % log_every == 0 or step == total
                eval_now = (eval_every > 0 and step % eval_every == 0) or step == total
                save_now = self.ckpt.should_save(step)
                exact = log_now or eval_now or save_now or exact_callbacks or step == first
                if exact:
                    gate.flush()  # exact counters and LR schedule from here on
                if exact or read_every_step:
                    r.losses.extend(_read_losses(pending))
                    pending.clear()
                    progress.update(step, loss=r.losses[-1], items=t.items_per_step)
                else:  # a lagged gate has the previous step's loss on the host already
                    last = gate.last if gate.lagged else None
                    loss = None if last is None else last.loss
                    progress.update(step, loss=loss, items=t.items_per_step)
                row: dict[str, Any] = {}
                if eval_now:
                    window.pause()
                    row = r.eval[step] = t.evaluate()
                    window.resume()
                if log_now:
                    t.accelerator.synchronize()
                    row = {**self._log_row(step, out, window.take()), **row}
                if row:
                    self.metrics.log(step, row)
                    self.logged_step = step
                for callback in self.callbacks:
                    callback.on_step_end(self, step, out)
                if save_now:
                    window.pause()
                    self._save(step)
                    window.resume()
                if eval_now or save_now:
                    self.watchdog.touch()  # a save or eval is no step to time
                if stop.should_stop():
                    r.stopped_by_signal = stop.signal_name
                    break
            gate.flush()  # the end or an interruption: before the final save
            r.losses.extend(_read_losses(pending))

    def _log_row(self, step: int, out: StepOutput, step_time: float) -> dict[str, Any]:
        t = self.training
        row = {
            "loss": self.result.losses[-1],
            "lr": self.schedule.get_last_lr(),
            "grad_norm": _host(out.grad_norm),
            t.unit: step * t.items_per_step,
            "skipped_steps": self.guard.total_skipped,
            "step_time_s": step_time,
            f"{t.unit}_per_s": t.items_per_step / step_time if step_time > 0 else None,
        }
        row.update({k: _host(v) for k, v in out.metrics.items()})
        return row

    def _save(self, step: int) -> None:
        self.ckpt.save(step, self.state)
        self.last_saved = step

    def _finish(self) -> None:
        cfg, t, r = self.cfg, self.training, self.result
        r.end_step = self.step
        if r.end_step > r.start_step and r.end_step not in r.eval:  # stopped early
            r.eval[r.end_step] = t.evaluate()
            if r.eval[r.end_step] and self.logged_step != r.end_step:
                self.metrics.log(r.end_step, r.eval[r.end_step])
        if cfg.checkpoint.save_on_exit and self.last_saved != self.step and r.end_step > 0:
            self._save(self.step)
        self.ckpt.close()
        r.checkpoint = self.ckpt.latest() if t.is_main else None
        r.metrics_path = self.metrics.jsonl_path
        if r.stopped_by_signal is None:
            r.export_dir = t.export()
        if t.is_main:
            title = f"{cfg.stack} {cfg.experiment}: {cfg.logging.run_name}"
            r.plot_path = rundir.plot_loss_curve(r.metrics_path, title=title)
        self._print_end()
        self.metrics.close(
            self._final_metrics(),
            status=trackers.FINISHED if r.stopped_by_signal is None else trackers.STOPPED,
        )
        if _distributed():
            dist.barrier()

    def _final_metrics(self) -> dict[str, Any]:
        """What the trackers keep as the run's result: the last step, the last training
        loss, the wall time, the held-out metrics at the end and the stack's numbers."""
        r = self.result
        final: dict[str, Any] = {"step": r.end_step, "elapsed_s": r.elapsed_s}
        if r.losses:
            final["loss"] = r.losses[-1]
        final.update(r.eval.get(r.end_step, {}))
        final.update(r.extra)  # only numbers reach the trackers
        return final

    # --- resume --------------------------------------------------------------------------

    def _start_fresh_if_asked(self) -> None:
        """``checkpoint.resume=none``: set the previous run's checkpoints and metrics aside."""
        cfg = self.cfg
        if str(cfg.checkpoint.resume) != "none":
            return
        if self.training.is_main:
            folders = [Path(cfg.logging.dir) / cfg.logging.run_name]
            if cfg.checkpoint.save_on_exit or cfg.checkpoint.every_steps > 0:
                folders.append(Path(cfg.checkpoint.dir))  # this run writes checkpoints there
            for old, new in rundir.set_aside(folders):
                self.console.print(
                    f"checkpoint.resume=none: set the previous run aside: {old} -> {new}"
                )
        if _distributed():
            dist.barrier()

    def _resume(self) -> None:
        cfg, t, r = self.cfg, self.training, self.result
        current = dataclasses.asdict(cfg)
        hyper = Hyperparameters(t.optimizers())
        tried: list[Path] = []

        def before_load(path: Path, manifest: Any) -> None:
            tried.append(path)
            # Another stack's run in the same output_dir is never resumed.
            check_resume_keys(path, manifest.config, current, ("stack", *t.resume_keys))
            check_precision_resume(path, manifest.config, current)
            r.changed = changed_keys(manifest.config, current)

        try:
            resumed = self.ckpt.resume(self.state, before_load=before_load)
        except UserError:
            raise
        except (ValueError, KeyError) as exc:  # a stack's state refused the checkpoint
            where = tried[-1] if tried else cfg.checkpoint.dir
            raise CheckpointError(
                f"cannot resume from {where}: {exc}. Fix: resume with the settings it was "
                "saved with, or start over with checkpoint.resume=none"
            ) from None
        if resumed is None:
            r.changed = {}
            return
        hyper.restore()  # this run's optim.* values, not the checkpoint's
        self.schedule.seek(self.schedule.position)  # this run's schedule, restored position
        self.step = r.start_step = r.end_step = int(self.state["step"])
        r.resumed_from = self.ckpt.last_loaded

    # --- what the run prints -------------------------------------------------------------

    def _print_start(self) -> None:
        cfg, r, say = self.cfg, self.result, self.console.print
        if r.resumed_from is not None:
            say(f"[bold green]Resumed[/] from {r.resumed_from} (step {r.start_step}).")
            if r.changed:
                say(
                    f"Changed since that checkpoint: {describe_changes(r.changed)}; this run's "
                    f"values apply from step {r.start_step} (the LR schedule too)."
                )
        elif str(cfg.checkpoint.resume) == "auto":
            say(f"No checkpoint in {cfg.checkpoint.dir}: starting fresh.")
        for line in self.training.describe():
            say(line)
        say(self.gate.describe())
        total = cfg.train.steps
        if r.start_step >= total:
            done = r.start_step
            say(
                f"Run already finished at step {done} (checkpoint {r.resumed_from}): nothing "
                f"to train; raise train.steps above {done} to train further (e.g. "
                f"train.steps={2 * done}), or checkpoint.resume=none to start over."
            )

    def _print_end(self) -> None:
        cfg, t, r, say = self.cfg, self.training, self.result, self.console.print
        took = r.end_step - r.start_step
        if r.stopped_by_signal:
            then = (
                "checkpoint saved: run the same command again to resume."
                if self.last_saved == r.end_step
                else "no checkpoint saved (checkpoint.save_on_exit=false)."
            )
            say(f"[bold yellow]Stopped by {r.stopped_by_signal}[/] at step {r.end_step}; {then}")
        if took > 0 and r.losses:
            # First and last windows that do not overlap: a short run compares its own ends.
            k = min(5, len(r.losses) // 2)
            rate = took * t.items_per_step / max(r.elapsed_s, 1e-9)
            if k == 0:
                trend = f"Train loss: {r.losses[-1]:.4f} (one step)"
            else:
                head, tail = sum(r.losses[:k]) / k, sum(r.losses[-k:]) / k
                steps = "step" if k == 1 else f"{k} steps"
                trend = f"Train loss (mean of first/last {steps}): {head:.4f} -> {tail:.4f}"
            say(
                f"Trained steps {r.start_step + 1}..{r.end_step} in {r.elapsed_s:.1f}s "
                f"({rate:,.0f} {t.unit}/s). {trend}"
            )
        for key, value in r.eval.get(r.end_step, {}).items():
            first = r.eval.get(r.start_step, {}).get(key)
            # eval_* are held-out metrics; other keys are a stack's own evaluation's
            name = f"Held-out {key[5:]}" if key.startswith("eval_") else f"Eval {key}"
            if took > 0 and first is not None and math.isfinite(first):
                say(f"{name}: {first:.4f} -> {value:.4f}")
            elif math.isfinite(value):
                say(f"{name} at step {r.end_step}: {value:.4f}")
        latest = r.checkpoint.name if r.checkpoint else "-"
        say(f"Checkpoints: {cfg.checkpoint.dir} (latest: {latest})")
        say(f"Metrics:     {r.metrics_path}")
        say(f"Config:      {r.metrics_path.with_name(rundir.CONFIG_NAME)}")
        for tracker in self.metrics.trackers:
            say(tracker.where())
        if r.plot_path is not None:
            say(f"Loss curve:  {r.plot_path}")
        for line in t.report(r):
            say(line)


def run_training(
    cfg: Any,
    build: Callable[[Any], Training],
    *,
    callbacks: Iterable[Callback] = (),
    on_step: Callable[[int], None] | None = None,
) -> RunResult:
    """``build(cfg)`` (a stack's ``build_training``), then ``Trainer.fit``; the built run is
    closed afterwards, also when training fails. What every stack's ``train`` command runs."""
    cfg = typed_config(cfg)
    training = build(cfg)
    try:
        return Trainer(cfg, training, callbacks=callbacks, on_step=on_step).fit()
    finally:
        training.close()


def _read_losses(pending: list[Any]) -> list[float]:
    """The host values of ``pending`` (one stacked read per device)."""
    if not pending:
        return []
    tensors = [v for v in pending if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in pending]
    host = iter(torch.stack([v.detach().double().reshape(()) for v in tensors]).tolist())
    return [next(host) if isinstance(v, torch.Tensor) else float(v) for v in pending]


__all__ = [
    "STOP_SIGNALS",
    "Callback",
    "RunResult",
    "StepWindow",
    "Trainer",
    "run_training",
    "typed_config",
]
