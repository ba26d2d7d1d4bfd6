"""The torch step engine's assembly: the model, the step and the gate a stack's run uses.

A stack builds its model and optimizer inputs, then calls, in order:

- ``prepare_model``: recompute (``train.recompute``), the data-parallel strategy
  (``parallel.strategy``; left unwrapped with master weights) and per-block compile
  (``train.compile``);
- ``optim.build_optimizer``: the optimizer from ``optim.*``;
- ``build_step_fn``: the sync-free ``GraphableStep`` (graphed with ``train.cuda_graph``) where
  it applies (master weights, one micro-batch a step), else None: the eager ``train_step``;
- ``make_gate`` (from its ``Training.make_gate``, after the resume): ``LaggedGuard`` for the
  sync-free step, else core's synchronous ``UpdateGate`` with the line saying why.

Each trainer step then goes through ``graphable.run_step`` (a step function) or
``step.train_step`` (gradient accumulation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from longboat.core.engine.device_skip import GRAPH_WARMUP
from longboat.core.engine.torch.blocks import compile_blocks
from longboat.core.engine.torch.graphable import GraphableStep, LaggedGuard
from longboat.core.engine.torch.master_weights import MasterWeightAdamW
from longboat.core.engine.torch.strategy import ParallelSetup, parallelize, unwrap
from longboat.core.loop.cuda_graph import GraphedStep
from longboat.core.train.gate import UpdateGate

CUDA_GRAPH_WARMUP = GRAPH_WARMUP
"""Eager steps before ``train.cuda_graph`` captures the step."""


def prepare_model(
    model: nn.Module,
    setup: ParallelSetup,
    accelerator: Any,
    device: Any,
    *,
    precision: str,
    recompute: str,
    compile: bool,
    master_weights: bool,
    known_block_methods: Sequence[str] = (),
) -> tuple[nn.Module, int]:
    """``model`` (already on ``device``) recomputed, parallelized and compiled as configured;
    and how many blocks were compiled (0 without ``compile``)."""
    model = parallelize(
        model,
        setup,
        precision=precision,
        activation_checkpointing=recompute,
        device_ids=[device.index] if accelerator.device_type == "cuda" else None,
        master_weights=master_weights,
        known_block_methods=known_block_methods,
    )
    compiled = compile_blocks(unwrap(model)) if compile else 0
    return model, compiled


def build_step_fn(
    model: nn.Module,
    optimizer: Any,
    accelerator: Any,
    *,
    accum: int,
    precision: str,
    grad_clip: float,
    skip_nonfinite_loss: bool,
    cuda_graph: bool,
    eager_on_sync: bool = False,
    name: str = "train step",
) -> Any:
    """The sync-free step of master weights with one micro-batch a step (``GraphableStep``,
    replayed as one CUDA graph with ``cuda_graph``); None where it does not apply (the run
    steps through ``train_step``). ``skip_nonfinite_loss``: the device skips a non-finite
    loss exactly when the NaN guard would (``train.nan_guard.enabled``). ``eager_on_sync``: a
    host sync found before the capture turns the graph off (warned) instead of failing."""
    if not isinstance(optimizer, MasterWeightAdamW) or accum != 1:
        return None
    step_fn: Any = GraphableStep(
        model,
        optimizer,
        precision=precision,
        device_type=accelerator.device_type,
        grad_clip=grad_clip,
        skip_nonfinite_loss=skip_nonfinite_loss,
    )
    if cuda_graph:
        step_fn = GraphedStep(
            step_fn,
            accelerator=accelerator,
            warmup=CUDA_GRAPH_WARMUP,
            name=name,
            eager_on_sync=eager_on_sync,
        )
    return step_fn


def make_gate(
    guard: Any,
    schedule: Any,
    *,
    step_fn: Any,
    optimizer: Any,
    accum: int,
    total_steps: int,
    accelerator: Any,
) -> UpdateGate:
    """``LaggedGuard`` for the sync-free step (no host read per step), else core's synchronous
    gate with the reason it is synchronous."""
    if step_fn is not None and guard.cfg.enabled:
        return LaggedGuard(
            guard, schedule, optimizer, total_steps=total_steps, accelerator=accelerator
        )
    return UpdateGate(guard, schedule, why_sync=sync_gate_reason(step_fn, optimizer, accum))


def sync_gate_reason(step_fn: Any, optimizer: Any, accum: int) -> str | None:
    """Why the step takes the synchronous gate (None: it has a step function, so only a
    disabled guard keeps it synchronous)."""
    if step_fn is not None:
        return None
    if not isinstance(optimizer, MasterWeightAdamW):
        return (
            "the eager step needs the verdict before its update; bf16 with "
            "train.master_weights=true skips on the device"
        )
    return f"gradient accumulation ({accum} micro-batches a step) runs the eager step"


def describe_step(step_fn: Any) -> str:
    """One phrase naming the step the run takes (for the run's description)."""
    if step_fn is None:
        return "train_step"
    how = "GraphableStep (master weights)"
    if isinstance(step_fn, GraphedStep):
        graph = step_fn.reason and f"eager ({step_fn.reason})"
        how += f", train.cuda_graph: {graph or f'captured after {CUDA_GRAPH_WARMUP} steps'}"
    return how
