"""The part of a run every Megatron stack shares: process group, parallel state, teardown.

``MegatronTraining.__init__`` quiets megatron, picks the accelerator, sets the CPU thread
count, runs the stack's ``check`` (cheap config checks, before any process group exists),
joins torchrun's process group or makes a one-rank one (megatron needs groups), then calls
the stack's ``_build``; a failure there tears down what was set up. ``init_layout`` builds
megatron's parallel state; ``close`` undoes all of it and releases the DDP-wrapped modules
the stack put in ``ddp_modules`` (``optimizer.release_ddp``: otherwise they outlive the run).
``engine_gate`` is the update gate of the stack's step (a ``MegatronStepEngine`` in
``step_fn``: CUDA-graph step, lagged or synchronous NaN gate, by the engine's rules).
``rank_view`` names a rank's shard of a model-parallel model by its coordinates for
checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from longboat.core.train.training import Training


class MegatronTraining(Training):
    """Base of a Megatron stack's run (see the module doc); subclasses implement ``_build``."""

    def __init__(self, cfg: Any, *, num_threads: int = 0) -> None:
        from longboat.core.device import get_accelerator
        from longboat.core.distributed import (
            check_precision_hardware,
            init_distributed,
            single_process_group,
        )
        from longboat.core.megatron.quiet import quiet_megatron

        quiet_megatron()
        self.cfg = cfg
        self.check(cfg)
        self.accelerator = get_accelerator()
        check_precision_hardware(cfg.train.precision, self.accelerator)  # fp8: before any work
        self._threads = torch.get_num_threads()
        if self.accelerator.device_type == "cpu" and num_threads > 0:
            torch.set_num_threads(num_threads)
        info = init_distributed(self.accelerator)
        self.is_main = info.is_main
        self._owns_group = single_process_group(self.accelerator)
        self._layout_up = False
        self.ddp_modules: list[torch.nn.Module] = []
        try:
            self._build(info.rank)
        except BaseException:
            self.close()
            raise

    def check(self, cfg: Any) -> None:
        """Config checks that need no process group (raise ``ConfigError``)."""

    def _build(self, rank: int) -> None:
        raise NotImplementedError

    def init_layout(self, parallel: Any, seed: int) -> Any:
        """megatron's parallel state for ``parallel`` (torn down by ``close``)."""
        from longboat.core.megatron import parallel_state as mparallel

        self.layout = mparallel.initialize(parallel, self.accelerator, seed=seed)
        self._layout_up = True
        return self.layout

    def engine_gate(self, guard: Any, schedule: Any, *, microbatches: int) -> Any:
        """The gate ``step_fn`` (a ``MegatronStepEngine``) picks for this run from
        ``train.cuda_graph``, ``optim.*`` and the NaN guard (called after the resume);
        ``microbatches``: this rank's microbatches a step."""
        cfg = self.cfg
        return self.step_fn.make_gate(
            guard,
            schedule,
            self.accelerator,
            cuda_graph=cfg.train.cuda_graph,
            microbatches=microbatches,
            pipeline_parallel=cfg.parallel.pipeline_parallel,
            optim=cfg.optim,
            total_steps=cfg.train.steps,
        )

    def close(self) -> None:
        from longboat.core.megatron.optimizer import release_ddp

        release_ddp(self.ddp_modules)
        self.ddp_modules = []
        if self._layout_up:
            from longboat.core.megatron import parallel_state as mparallel

            mparallel.destroy()
            self._layout_up = False
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
        torch.set_num_threads(self._threads)


def rank_view(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], prefix: str
) -> torch.nn.Module:
    """A module holding ``named_params`` under ``<prefix>__<name with dots as __>``: every
    model-parallel rank holds a different shard under the same names, so a checkpoint keys
    them by the rank's coordinates."""
    view = torch.nn.Module()
    for name, p in named_params:
        view.register_parameter(f"{prefix}__{name.replace('.', '__')}", p)
    return view


def rank_prefix() -> str:
    """``tp<r>_pp<r>_ep<r>``: this rank's tensor / pipeline / expert coordinates."""
    from megatron.core import parallel_state as mps

    return (
        f"tp{mps.get_tensor_model_parallel_rank()}_pp{mps.get_pipeline_model_parallel_rank()}"
        f"_ep{mps.get_expert_model_parallel_rank()}"
    )
