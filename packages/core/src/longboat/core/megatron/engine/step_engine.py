"""The megatron step engine: what llm, vlm and diffusion share below their forward + loss.

A stack's step subclasses ``MegatronStepEngine`` and gives it two things: the megatron
optimizer it built (``optimizer``; ``engine.ddp.wrap_and_build`` or core's
``build_optimizer``) and ``forward_backward(microbatches)`` (zero the grads, its forward +
loss + backward over a step's microbatches, the gradient reduction; the step's mean loss as
a 0-d device tensor, equal on every rank, with no host read). The engine owns the rest:

- the update: megatron's step (``optimizer_step``: no grad-norm host read without clipping)
  or the one-pass AdamW update (``engine.one_pass_adamw``, ``use_one_pass``), and the grad
  norm a log line reads;
- the gate between backward and update (``make_gate``), picked by these rules: the CUDA-graph
  step (``engine.graphed_step``) where ``train.cuda_graph`` asks for it and it applies, else
  the lagged NaN gate (``engine.lagged_gate``: the skip on the device, the verdict one step
  late) where the update can skip on the device, else the synchronous gate (the loss read
  every step). Every lever that cannot apply leaves one line (``notices``) saying why and
  what runs instead;
- one trainer step (``run_step``) through whichever was picked.

``train.cuda_graph``: null (auto) captures where the accelerator has CUDA graphs and the step
allows it; true asks for it (a ``ConfigError`` where the step cannot be captured; on an
accelerator without CUDA graphs the same step runs eagerly, logged); false never.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from longboat.core.config.errors import ConfigError
from longboat.core.train.gate import UpdateGate
from longboat.core.train.training import StepOutput


class MegatronStepEngine:
    """The step engine (module doc); subclasses set ``optimizer`` and implement
    ``forward_backward``."""

    optimizer: Any
    """megatron's (distributed, chained) optimizer."""
    one_pass: Any = None
    """``OnePassAdamW`` when the update runs as one pass per shard."""
    one_pass_blocker: str | None = None
    """Why the one-pass update was asked for but does not apply, if so."""
    graph_ready: bool = False
    """DDP was constructed under a side stream (``engine.ddp.construction_stream``): the step
    can be captured."""
    graph_step: Any = None
    """The ``GraphedTrainStep`` ``make_gate`` picked, if any."""
    gate_notice: str | None = None
    """The line saying why ``train.cuda_graph`` runs eager steps, if so."""
    static_shapes_blocker: str | None = None
    """Why the step's input shapes (or host values) change between steps, if they do (set
    by the stack from its data): a graph replays one set."""

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        """Extra 0-d device scalars of the last ``forward_backward`` (none by default)."""
        return getattr(self, "_metrics", {})

    @metrics.setter
    def metrics(self, value: dict[str, torch.Tensor]) -> None:
        self._metrics = value

    # --- what a stack implements ----------------------------------------------------------

    def forward_backward(self, microbatches: list[dict[str, Any]]) -> torch.Tensor:
        """Zero the grads, forward + backward over ``microbatches``, reduce the grads; the
        step's mean loss as a 0-d device tensor (no host read)."""
        raise NotImplementedError

    def loss_and_grads(self, step: int, microbatches: list[dict[str, Any]]) -> torch.Tensor:
        """``forward_backward`` of trainer step ``step`` (a stack whose loss depends on the
        step, e.g. its noise, overrides this)."""
        return self.forward_backward(microbatches)

    def graph_inputs(self, step: int, microbatches: list[dict[str, Any]]) -> dict[str, Any]:
        """The tensors the captured step reads, copied into its static buffers each step
        (default: the one microbatch). Everything that changes between steps must be here."""
        return microbatches[0]

    def graph_forward_backward(self, inputs: dict[str, Any]) -> torch.Tensor:
        """``forward_backward`` of the captured step on ``graph_inputs`` (default: the one
        microbatch)."""
        return self.forward_backward([inputs])

    def graph_modules(self) -> Iterable[torch.nn.Module]:
        """The modules searched for a layer that reads on the host (graph blocker)."""
        return ()

    # --- the update -------------------------------------------------------------------------

    def use_one_pass(
        self, mode: bool | str, kernel: Callable[..., Any], moment_dtype: str | None = None
    ) -> None:
        """The one-pass update with ``kernel`` (``longboat.kernels.adamw_master_step_``):
        True requires it (ValueError where the optimizer cannot take it), ``"auto"`` uses it
        where it applies and records why not in ``one_pass_blocker``, False leaves megatron's
        step. ``moment_dtype`` (``optim.moment_dtype``; null: fp32): bf16 moments, kept by
        the one-pass update only, so a ``ConfigError`` where it does not take every step."""
        from longboat.core.megatron.engine import one_pass_adamw
        from longboat.core.megatron.engine.moments import moment_torch_dtype

        dtype = moment_torch_dtype(moment_dtype)
        self.one_pass, self.one_pass_blocker = None, None
        if mode == "auto":
            self.one_pass_blocker = one_pass_adamw.supported(self.optimizer)
        if dtype != torch.float32 and (not mode or self.one_pass_blocker is not None):
            why = self.one_pass_blocker or "optim.one_pass_adamw=false"
            raise ConfigError(
                f"bf16 moments are kept by the one-pass AdamW update only, and this run "
                f"takes megatron's step ({why})",
                key="optim.moment_dtype",
                value=moment_dtype,
                fix="set optim.moment_dtype=fp32 (or null)",
            )
        if not mode:
            return
        if self.one_pass_blocker is None:
            self.one_pass = one_pass_adamw.OnePassAdamW(self.optimizer, kernel, dtype)

    def update(self, found_inf: torch.Tensor | None = None) -> Any:
        """The optimizer update of the grads just computed; the grad norm when the update
        computed one (clipping), else None. ``found_inf`` (nonzero: skip on the device) is
        passed to ``OnePassAdamW``; megatron's fused AdamW reads its own ``found_inf``."""
        from longboat.core.megatron.optimizer import optimizer_step

        if self.one_pass is not None and self.one_pass.step(found_inf=found_inf):
            return self.one_pass.last_grad_norm
        return optimizer_step(self.optimizer)[1]

    def grad_norm(self) -> Any:
        """The global grad norm of the step just taken (until the next ``zero_grad``): for log
        lines, where a norm the update did not compute costs one reduction."""
        if self.one_pass is not None and self.one_pass.handles():
            return self.one_pass.logged_grad_norm()
        return self.optimizer.get_grad_norm()

    # --- the gate and the trainer's step ----------------------------------------------------

    def make_gate(
        self,
        guard: Any,
        schedule: Any,
        accelerator: Any,
        *,
        cuda_graph: bool | None,
        microbatches: int,
        pipeline_parallel: int,
        optim: Any,
        total_steps: int,
    ) -> UpdateGate:
        """The run's gate (the module doc's rules). Build it after the resume: the lagged
        and graphed paths switch the loaded param groups to fused AdamW."""
        from longboat.core.megatron.engine import graphed_step, lagged_gate

        self.graph_step, self.gate_notice = None, None
        if cuda_graph is not False:
            layout = (microbatches, pipeline_parallel)
            why = self._graph_blocker(accelerator, cuda_graph, *layout, optim)
            if why is None:
                self.graph_step = graphed_step.GraphedTrainStep(
                    self,
                    schedule,
                    accelerator,
                    total_steps=total_steps,
                    skip_non_finite=guard.cfg.enabled,
                )
                return self.graph_step.gate(guard, schedule, accelerator)
            if cuda_graph:
                raise ConfigError(
                    f"this run's step cannot be captured: {why}",
                    key="train.cuda_graph",
                    value=True,
                    fix="set train.cuda_graph=null (eager steps where it cannot apply) or false",
                )
            self.gate_notice = f"train.cuda_graph: eager steps ({why})."
        why_sync = lagged_gate.lagged_guard_blocker(
            self.optimizer, guard.cfg, one_pass=self.one_pass, fused=optim.fused
        )
        if why_sync is None:
            return lagged_gate.LaggedLossGuard(
                guard,
                schedule,
                self.optimizer,
                accelerator,
                one_pass=self.one_pass is not None,
            )
        return UpdateGate(guard, schedule, why_sync=why_sync)

    def _graph_blocker(
        self,
        accelerator: Any,
        cuda_graph: bool | None,
        microbatches: int,
        pipeline_parallel: int,
        optim: Any,
    ) -> str | None:
        from longboat.core.megatron.engine import graphed_step

        if cuda_graph is None and accelerator.graph_backend() is None:
            return f"the {accelerator.device_type} accelerator has no CUDA graphs"
        if not self.graph_ready:
            return "the step was built without a side stream for its DDP (cuda_graph=False)"
        if self.static_shapes_blocker is not None:
            return self.static_shapes_blocker
        return graphed_step.graph_blocker(
            microbatches=microbatches,
            pipeline_parallel=pipeline_parallel,
            optimizer=self.optimizer,
            one_pass=self.one_pass,
            grad_clip=float(optim.grad_clip),
            fused=bool(optim.fused),
            modules=self.graph_modules(),
        )

    def run_step(
        self, step: int, microbatches: list[dict[str, Any]], gate: UpdateGate
    ) -> StepOutput:
        """One trainer step on ``microbatches`` (already on the device) through the gate
        ``make_gate`` returned."""
        if self.graph_step is not None:
            out = self.graph_step(self.graph_inputs(step, microbatches))
            gate.allow(step, out["loss"])
            return StepOutput(
                loss=out["loss"],
                grad_norm=self._norm_reader(gate, out.get("grad_norm")),
                metrics={k: v for k, v in out.items() if k not in ("loss", "grad_norm")},
            )
        loss = self.loss_and_grads(step, microbatches)
        norm = None
        if gate.allow(step, loss):
            norm = self.update(found_inf=getattr(gate, "found_inf", None))
        return StepOutput(
            loss=loss, grad_norm=self._norm_reader(gate, norm), metrics=dict(self.metrics)
        )

    def _norm_reader(self, gate: UpdateGate, norm: Any) -> Callable[[], Any]:
        """The step's grad norm, read only on log lines (after the gate is flushed): None for
        a skipped step, else the norm the update computed or one reduction."""

        def read() -> Any:
            if gate.last is not None and not gate.last.stepped:
                return None
            return norm if norm is not None else self.grad_norm()

        return read

    def notices(self) -> list[str]:
        """One line per lever that was asked for and cannot apply (what runs instead)."""
        lines = []
        if self.one_pass_blocker:
            lines.append(f"optim.one_pass_adamw: megatron's step ({self.one_pass_blocker}).")
        if self.gate_notice:
            lines.append(self.gate_notice)
        return lines


__all__ = ["MegatronStepEngine"]
