"""``train.cuda_graph``: the whole training step replayed as one CUDA graph.

The captured function is one step on one microbatch: zero the grads, the stack's forward +
backward (``MegatronStepEngine.graph_forward_backward``), ``found_inf = not isfinite(loss)``
(the NaN guard's skip, on the device), each param group's LR from a device table indexed by
a device count of the updates taken (core's ``DeviceLRTable``: a skipped update does not
advance it), the update (megatron's fused AdamW reading ``found_inf``, or
``OnePassAdamW.step(found_inf=...)``) and the table's advance. Nothing in it reads on the
host, so the host never waits for the device; the NaN guard's host side runs one step late
(core's ``LaggedUpdateGate``).

``graph_blocker`` says where the graph cannot apply; the run then steps eagerly (the start
of the run says why).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from longboat.core.engine.device_skip import (
    GRAPH_WARMUP,
    install_found_inf,
    mark_non_finite,
    remove_found_inf,
)
from longboat.core.megatron.engine.lagged_gate import device_found_inf
from longboat.core.megatron.optimizer import inner_optimizers
from longboat.core.train.gate import LaggedUpdateGate
from longboat.core.train.schedule import DeviceLRTable


def graph_blocker(
    *,
    microbatches: int,
    pipeline_parallel: int,
    optimizer: Any,
    one_pass: Any,
    grad_clip: float,
    fused: bool,
    modules: Iterable[torch.nn.Module] = (),
) -> str | None:
    """None when the step can be captured, else why not. (An accelerator without CUDA graphs
    runs the same step eagerly: ``GraphedStep`` says so.) ``modules``: the model's, searched
    for a layer that reads on the host (megatron's MoE token counts) or that declares why a
    graph cannot record it (a ``cuda_graph_blocker`` attribute that is a non-empty str)."""
    if microbatches != 1:
        return (
            f"{microbatches} microbatches a step (a graph captures one: set "
            "train.global_batch_size = train.micro_batch_size x data parallel)"
        )
    if pipeline_parallel > 1:
        return "pipeline parallelism (its point-to-point schedule is not captured)"
    from longboat.core.megatron.grouped_experts import moe_host_sync

    modules = list(modules)
    moe_sync = moe_host_sync(modules)
    if moe_sync is not None:
        return moe_sync
    declared = next((b for m in modules if (b := getattr(m, "cuda_graph_blocker", None))), None)
    if declared:
        return str(declared)
    parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    if any(getattr(p, "grad_scaler", None) is not None for p in parts):
        return "fp16 loss scaling (megatron's step reads found_inf on the host)"
    if grad_clip > 0 and (one_pass is None or not one_pass.handles()):
        return (
            "optim.grad_clip > 0 through megatron's step (it reads the grad norm on the "
            "host): set optim.one_pass_adamw=true, which clips on the device"
        )
    if not fused and one_pass is None:
        return "optim.fused=false (only torch's fused AdamW skips an update on found_inf)"
    return None


class GraphedTrainStep:
    """A ``MegatronStepEngine`` + the run's LR schedule as one CUDA-graph-replayed step
    (module doc).

    Build it after the resume, with the trainer's ``RunSchedule`` (its schedulers become the
    device tables; the inner AdamW param groups get device-tensor LRs).
    """

    def __init__(
        self,
        step: Any,
        schedule: Any,
        accelerator: Any,
        *,
        total_steps: int,
        skip_non_finite: bool = True,
        name: str = "train.cuda_graph",
    ) -> None:
        from longboat.core.loop import GraphedStep
        from longboat.core.megatron.optimizer import capturable_torch_adamw

        self.step = step
        self.skip_non_finite = skip_non_finite
        """Skip an update whose loss is not finite (the NaN guard is on)."""
        self.inners = inner_optimizers(step.optimizer)
        capturable_torch_adamw(step.optimizer, (accelerator.device_type,))
        self.found_inf = device_found_inf(step.optimizer)
        if step.one_pass is None:
            install_found_inf(self.inners, self.found_inf)
        self.tables = [
            DeviceLRTable(
                s, [g["lr"] for g in s.optimizer.param_groups], self.found_inf, total_steps
            )
            for s in schedule.schedulers
        ]
        self.graph = GraphedStep(
            self._step,
            accelerator=accelerator,
            warmup=GRAPH_WARMUP,
            name=name,
            eager_on_sync=True,
        )

    def _step(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        loss = self.step.graph_forward_backward(batch)
        if self.skip_non_finite:
            mark_non_finite(self.found_inf, loss)
        for table in self.tables:
            table.load()
        norm = self.step.update(found_inf=self.found_inf)
        for table in self.tables:
            table.advance()
        out = {"loss": loss, **self.step.metrics}
        if norm is not None:
            out["grad_norm"] = norm
        return out

    def __call__(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """One step; fresh tensors (the graph's outputs are overwritten by the next replay)."""
        return {k: v.clone() for k, v in self.graph(batch).items()}

    def gate(self, guard: Any, schedule: Any, accelerator: Any) -> LaggedUpdateGate:
        """The run's gate: the skip happened inside the step; the host side one step late."""
        return _GraphGate(guard, schedule, accelerator, self)

    def close(self) -> None:
        remove_found_inf(self.inners, self.found_inf)


class _GraphGate(LaggedUpdateGate):
    def __init__(self, guard: Any, schedule: Any, accelerator: Any, graphed: GraphedTrainStep):
        super().__init__(guard, schedule, accelerator)
        self.graphed = graphed

    def describe(self) -> str:
        how = "captured" if self.graphed.graph.active else f"eager: {self.graphed.graph.reason}"
        return f"CUDA graph: the whole step as one graph ({how}). {super().describe()}"

    def close(self) -> None:
        self.graphed.close()


__all__ = ["GRAPH_WARMUP", "GraphedTrainStep", "graph_blocker"]
