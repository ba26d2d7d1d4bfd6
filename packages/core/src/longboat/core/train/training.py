"""What a stack hands the trainer: its built run (``Training``) and one step's output.

A stack's ``build_training(cfg)`` assembles everything the run needs from the typed config
(model, optimizer, data, the step) and returns a ``Training``; ``longboat.core.train.Trainer``
owns the loop around it (resume, signals, progress, metrics, NaN guard, LR schedule,
checkpoints, eval, profiling, export, the loss curve). The command line and the benchmarks
call the same ``build_training``, so what is measured is what a user runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from longboat.core.loop.nan_guard import NaNGuard
    from longboat.core.train.gate import UpdateGate
    from longboat.core.train.schedule import RunSchedule


@dataclass
class StepOutput:
    """What one optimizer step reports."""

    loss: Any
    """The step's mean loss over the global batch: a 0-d device tensor (read on the host only
    at log lines) or a float."""
    grad_norm: Any = None
    """Global grad norm: a tensor, a float, None, or a zero-argument callable the trainer calls
    only on log lines (after the gate is flushed) when computing it costs a reduction."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Extra scalars to log (0-d device tensors or floats)."""


class Training:
    """A stack's built run. Subclasses set the attributes and implement the four methods
    marked *required*; the others have defaults."""

    unit: str = "samples"
    """What ``items_per_step`` counts: ``tokens`` or ``samples`` (progress bar, metrics)."""
    items_per_step: int = 0
    """Tokens or samples one optimizer step trains on (all ranks)."""
    resume_keys: tuple[str, ...] = ()
    """Config keys a checkpoint must share with this run to be resumed (the parallel layout,
    the model shape, ...): a mismatch is reported naming the key before anything loads."""
    is_main: bool = True
    """True on the rank that prints and writes metrics (global rank 0)."""
    accelerator: Any = None
    """The accelerator the run trains on (``longboat.core.device``)."""

    def state(self) -> dict[str, Any]:
        """*Required.* The checkpoint entries the stack owns (``model``, ``optimizer``, a data
        position, ...); the trainer adds ``lr_scheduler``, ``nan_guard``, ``rng`` and
        ``step``. Values are modules, optimizers, objects with ``state_dict`` /
        ``load_state_dict`` or plain values (``CheckpointManager``)."""
        raise NotImplementedError

    def optimizers(self) -> list[Any]:
        """*Required.* The torch optimizers whose param groups the LR schedule drives (and
        whose hyperparameters come from the config again after a resume)."""
        raise NotImplementedError

    def batches(self, start_step: int) -> Iterator[Any]:
        """*Required.* This rank's input of every step from ``start_step`` on (0-based)."""
        raise NotImplementedError

    def step(self, step: int, batch: Any, gate: UpdateGate) -> StepOutput:
        """*Required.* One optimizer step on ``batch``: forward, backward, then
        ``gate.allow(step, loss, grad_norm)`` and the update when it allows it."""
        raise NotImplementedError

    def make_gate(self, guard: NaNGuard, schedule: RunSchedule) -> UpdateGate:
        """The update gate of this run (called after the resume). Default: the synchronous
        gate; a stack whose step can skip on the device returns a ``LaggedUpdateGate``."""
        from longboat.core.train.gate import UpdateGate

        return UpdateGate(guard, schedule)

    def callbacks(self) -> list[Any]:
        """``Callback``s of the run's own (e.g. a preview every n steps), added to the
        trainer's; default none."""
        return []

    def after_resume(self, step: int) -> None:
        """Called once the checkpoint (if any) is loaded, before the first step."""

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (``{"eval_loss": ...}``), computed at the start, every
        ``train.eval_every`` steps and at the end; empty when the stack has none."""
        return {}

    def export(self) -> Path | None:
        """Write the trained model in its interchange format after a finished run; returns
        where (None: nothing exported)."""
        return None

    def describe(self) -> list[str]:
        """Lines printed at the start of a run (model, data, layout)."""
        return []

    def report(self, result: Any) -> list[str]:
        """Lines printed at the end of a run, after the trainer's own (e.g. a generation)."""
        return []

    def close(self) -> None:
        """Release what ``build_training`` set up (process groups, parallel state, threads)."""


class FedTraining:
    """A built run that takes its input from ``batches(start_step)`` instead of its own
    ``Training.batches``; every other attribute and method is the run's own (read through).

    ``Trainer(cfg, FedTraining(training, batches))`` trains the same model, optimizer and step
    on other input without changing the built run: the benchmarks time the wait for each batch
    by wrapping the run's own iterator, and the loss alignments feed the batches they also give
    a reference implementation.
    """

    def __init__(self, training: Training, batches: Callable[[int], Iterator[Any]]) -> None:
        self.training = training
        """The built run."""
        self.feed = batches
        """``start_step -> iterator`` of the input of every step from ``start_step`` on."""

    def batches(self, start_step: int) -> Iterator[Any]:
        """The fed input from ``start_step`` on."""
        return self.feed(start_step)

    def __getattr__(self, name: str) -> Any:
        if name in ("training", "feed"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.training, name)


__all__ = ["FedTraining", "StepOutput", "Training"]
