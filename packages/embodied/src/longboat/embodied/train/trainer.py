"""``longboat-embodied train``: compose -> validate -> build -> train -> checkpoint -> export.

The loop parts (metrics, progress bar, NaN guard, signals, profiler, LR schedule,
checkpoints, RNG) all come from core; this module wires them to the embodied
data, models and data-parallel strategies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from longboat.core.checkpoint import CheckpointManager
from longboat.core.config.errors import ConfigError
from longboat.core.config.validate import validate
from longboat.core.device import get_accelerator
from longboat.core.distributed import init_distributed, resolve_parallel
from longboat.core.loop.cuda_graph import GraphedStep
from longboat.core.loop.lr_schedule import build_lr_scheduler
from longboat.core.loop.metrics import MetricsSink
from longboat.core.loop.nan_guard import NaNGuard
from longboat.core.loop.profiler import StepProfiler
from longboat.core.loop.progress import TrainProgress
from longboat.core.loop.signals import GracefulShutdown
from longboat.core.rng import RNGState
from longboat.embodied.config import EmbodiedExperimentConfig
from longboat.embodied.models import apply_freezing, build_model, get_config
from longboat.embodied.parallel import (
    MasterWeightAdamW,
    ParallelSetup,
    ZeroShardState,
    build_optimizer,
    parallelize,
)
from longboat.embodied.train.datasets import ensure_synthetic, open_dataset
from longboat.embodied.train.export import export_policy
from longboat.embodied.train.loader import RankMicroBatches, build_loader
from longboat.embodied.train.plan import BatchLayout, GlobalBatchPlan
from longboat.embodied.train.policy_batch import PolicyCollator, batch_spec, to_device
from longboat.embodied.train.step import GraphableStep, LaggedGuard, run_step, train_step

log = logging.getLogger(__name__)


class DataPosition:
    """Checkpointed data position: the plan is a function of the step, this validates it."""

    def __init__(self, plan: GlobalBatchPlan) -> None:
        self.plan = plan
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return self.plan.state_dict(self.step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.plan.state_dict(0)
        for key in ("seed", "shuffle", "num_samples", "global_batch"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"the checkpoint's data order has {key}={state[key]!r}, this run "
                    f"{key}={mine[key]!r}; resume with the same dataset, data.seed, "
                    "data.shuffle and train.global_batch_size (or checkpoint.resume=none)"
                )


@dataclass
class TrainResult:
    """What a finished (or interrupted) run reports."""

    steps_done: int
    """Optimizer steps completed (including those before a resume)."""
    resumed_from: int | None
    """Step of the checkpoint the run resumed from, if any."""
    losses: list[float] = field(default_factory=list)
    """Loss of every step this process ran."""
    interrupted: bool = False
    """True when a signal stopped the run early (after a checkpoint)."""
    export_dir: str | None = None
    """Where the policy was exported (None when export is off or interrupted)."""


def _as_config(cfg: Any) -> EmbodiedExperimentConfig:
    if isinstance(cfg, DictConfig):
        obj = OmegaConf.to_object(cfg)
    else:
        obj = cfg
    if not isinstance(obj, EmbodiedExperimentConfig):
        raise TypeError(
            f"train() needs an EmbodiedExperimentConfig (compose one with "
            f"longboat.core.config.compose.compose_experiment), got {type(obj).__name__}"
        )
    return obj


def _model_overrides(cfg: EmbodiedExperimentConfig) -> dict[str, Any]:
    overrides = dict(cfg.model.overrides)
    # fp32 runs keep frozen weights in fp32 too (the bf16 split is the reference's
    # mixed-precision layout; without autocast it would only cost accuracy).
    if cfg.train.precision == "fp32":
        overrides.setdefault("frozen_dtype", "float32")
    return overrides


def train(cfg: Any) -> TrainResult:
    """Run one embodied experiment from a composed config (see ``EmbodiedExperimentConfig``)."""
    cfg = _as_config(cfg)
    accelerator = get_accelerator()
    info = init_distributed(accelerator)
    validate(cfg, world_size=info.world_size)  # every key, before any heavy init
    parallel = resolve_parallel(cfg.parallel, info.world_size)
    dp = parallel.data_parallel
    mbs = cfg.train.micro_batch_size
    layout = BatchLayout(cfg.train.global_batch_size or mbs * dp, mbs, dp)
    is_main = info.rank == 0
    device = accelerator.device(info.local_rank)
    output_dir = Path(cfg.output_dir)

    overrides = _model_overrides(cfg)
    model_cfg = get_config(cfg.model.name, cfg.model.flavor, overrides)
    root = (
        Path(cfg.data.path)
        if cfg.data.path
        else ensure_synthetic(cfg.data, cfg.model.name, model_cfg, output_dir, is_main)
    )
    dataset, cameras, image_hw = open_dataset(cfg.data, root, model_cfg.action_horizon)
    collate = PolicyCollator(
        batch_spec(cfg.model.name, model_cfg, len(cameras), image_hw),
        cameras,
        fixed_text_length=cfg.train.cuda_graph,  # one set of shapes for the graph
    )
    plan = GlobalBatchPlan(len(dataset), layout, seed=cfg.data.seed, shuffle=cfg.data.shuffle)

    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    model = build_model(cfg.model.name, model_cfg)
    counts = apply_freezing(model, model_cfg)
    model.to(device)
    setup = ParallelSetup(
        strategy=parallel.strategy,
        world_size=info.world_size,
        rank=info.rank,
        replicate=parallel.data_parallel_replicate,
        device_type=accelerator.device_type,
    )
    model = parallelize(
        model,
        setup,
        precision=cfg.train.precision,
        activation_checkpointing=cfg.train.activation_checkpointing,
        device_ids=[info.local_rank] if accelerator.device_type == "cuda" else None,
        master_weights=cfg.train.master_weights,
    )
    optimizer = build_optimizer(
        model,
        cfg.optim,
        setup,
        master_weights=cfg.train.master_weights,
        master_storage=cfg.train.master_weight_storage,
        master_update=cfg.train.master_weight_update,
    )
    scheduler = build_lr_scheduler(optimizer, cfg.optim.schedule, cfg.train.steps)
    nan_guard = NaNGuard(cfg.train.nan_guard)
    if cfg.train.cuda_graph and layout.accum != 1:
        raise ConfigError(
            f"captures one micro-batch per step; this layout accumulates {layout.accum}",
            key="train.cuda_graph",
            value=True,
            fix=f"set train.global_batch_size={mbs * dp} or train.cuda_graph=false",
        )
    # Master weights with one micro-batch a step: the sync-free GraphableStep (graphed or
    # not); otherwise train_step (synchronous NaN guard).
    step_fn: Any = None
    if isinstance(optimizer, MasterWeightAdamW) and layout.accum == 1:
        step_fn = GraphableStep(
            model,
            optimizer,
            precision=cfg.train.precision,
            device_type=accelerator.device_type,
            grad_clip=cfg.optim.grad_clip,
            # The device skips a non-finite loss exactly when the guard would.
            skip_nonfinite_loss=cfg.train.nan_guard.enabled,
        )
        if cfg.train.cuda_graph:
            step_fn = GraphedStep(
                step_fn, accelerator=accelerator, warmup=3, name="embodied train step"
            )
    position = DataPosition(plan)
    state: dict[str, Any] = {
        "model": model,
        "optimizer": ZeroShardState(optimizer) if _is_zero(optimizer) else optimizer,
        "lr_scheduler": scheduler,
        "data": position,
        "nan_guard": nan_guard,
        "rng": RNGState.capture(accelerator),
    }
    ckpt = CheckpointManager(cfg.checkpoint, config_dict=dataclasses.asdict(cfg))
    resumed = ckpt.resume(state)
    start = resumed or 0
    position.step = start
    if resumed is not None:
        # LambdaLR restores its counters but not the optimizer's current LR.
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    # No per-step host sync: the guard's host side runs one step late (after the resume: the
    # device lr table starts at the restored schedule position).
    lagged = None
    if step_fn is not None and cfg.train.nan_guard.enabled:
        lagged = LaggedGuard(
            nan_guard, optimizer, scheduler, total_steps=cfg.train.steps, accelerator=accelerator
        )
    if is_main:
        log.info(
            "embodied %s/%s: %d trainable + %d frozen params, %s on %d rank(s), "
            "global batch %d = %d micro x %d dp x %d accum, start step %d",
            cfg.model.name,
            cfg.model.flavor,
            counts["trainable"],
            counts["frozen"],
            setup.strategy,
            info.world_size,
            layout.global_batch,
            mbs,
            dp,
            layout.accum,
            start,
        )

    dp_rank = info.rank  # embodied is data parallel only: dp rank == global rank
    micro = RankMicroBatches(dataset, plan, collate, dp_rank=dp_rank, seed=cfg.train.seed)
    loader = iter(
        build_loader(
            micro,
            start_step=start,
            total_steps=cfg.train.steps,
            num_workers=cfg.data.num_workers,
            pin_memory=accelerator.device_type == "cuda",
        )
    )
    result = TrainResult(steps_done=start, resumed_from=resumed)
    metrics = MetricsSink(
        cfg.logging.dir, cfg.logging.run_name, tensorboard=cfg.logging.tensorboard, enabled=is_main
    )
    step = start
    pending_losses: list[torch.Tensor] = []  # device losses of steps not yet logged
    # step_time_s / samples_per_s: wall time over the steps since the last log line, measured
    # between points where the device is synchronised (log lines, checkpoint saves, which are
    # not counted), so queued-but-unfinished work is never left out or counted twice.
    accelerator.synchronize()
    window = _StepWindow()

    def settle() -> None:
        """Resolve pending NaN-guard verdicts (waits for the last queued step)."""
        if lagged is not None:
            lagged.flush()
        else:
            accelerator.synchronize()

    with (
        metrics,
        GracefulShutdown() as shutdown,
        StepProfiler(cfg.train.profiler, output_dir / "profile") as profiler,
        TrainProgress(
            cfg.train.steps,
            unit="samples",
            enabled=is_main and cfg.logging.progress,
            initial_step=start,
        ) as progress,
    ):
        for step in range(start, cfg.train.steps):
            profiler.step(step + 1)  # steps are numbered from 1, as in metrics.jsonl
            batches = [to_device(next(loader), device) for _ in range(layout.accum)]
            common = dict(
                step=step,
                seed=cfg.train.seed,
                rank_offset=dp_rank * layout.accum,
                device_type=accelerator.device_type,
                device_index=device.index,
                host_sync=False,  # losses stay on the device until they are logged
            )
            if lagged is not None:
                out = run_step(step_fn, optimizer, batches[0], lagged=lagged, **common)
            elif step_fn is not None:
                out = run_step(
                    step_fn,
                    optimizer,
                    batches[0],
                    should_step=nan_guard.check,  # disabled: True without reading the loss
                    scheduler=scheduler,
                    **common,
                )
            else:
                out = train_step(
                    model,
                    optimizer,
                    batches,
                    precision=cfg.train.precision,
                    grad_clip=cfg.optim.grad_clip,
                    should_step=nan_guard.check,
                    scheduler=scheduler,
                    **common,
                )
            done = step + 1
            position.step = done
            result.steps_done = done
            pending_losses.append(out.loss)
            window.steps += 1
            if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                settle()
                dt = window.take()
                stepped = out.stepped if lagged is None else lagged.last.stepped
                # One device -> host copy for every scalar of the step.
                names = sorted(out.metrics)
                host = torch.stack(
                    [out.loss.double(), out.grad_norm.double().to(out.loss.device)]
                    + [out.metrics[k].double() for k in names]
                ).tolist()
                result.losses.extend(float(v) for v in pending_losses)
                pending_losses.clear()
                progress.update(done, loss=host[0], items=layout.global_batch)
                metrics.log(
                    done,
                    {
                        "loss": host[0],
                        "grad_norm": host[1],
                        "lr": scheduler.get_last_lr()[0],
                        "step_time_s": dt,
                        "samples_per_s": layout.global_batch / dt,
                        "skipped_step": not stepped,
                        **dict(zip(names, host[2:])),
                    },
                )
            else:
                progress.update(done, items=layout.global_batch)
            if ckpt.should_save(done):
                settle()  # exact NaN-guard counters and LR schedule in the checkpoint
                window.pause()
                state["rng"] = RNGState.capture(accelerator)
                ckpt.save(done, state)
                window.resume()
            if shutdown.should_stop():
                result.interrupted = True
                break
        if lagged is not None:
            lagged.flush()  # the end of training, or an interruption
    result.losses.extend(float(v) for v in pending_losses)  # an interrupted run's tail
    final = result.steps_done
    if cfg.checkpoint.save_on_exit and ckpt.last_saved_step != final and final > start:
        state["rng"] = RNGState.capture(accelerator)
        ckpt.save(final, state)
    ckpt.close()
    if cfg.export.enabled and not result.interrupted:
        export_dir = Path(cfg.export.dir) if cfg.export.dir else output_dir / "export"
        # Master weights: export the fp32 masters (the trained values), not their bf16 copy.
        masters = optimizer.master_params() if isinstance(optimizer, MasterWeightAdamW) else None
        with masters or contextlib.nullcontext():
            export_policy(
                model,
                export_dir,
                model_name=cfg.model.name,
                flavor=cfg.model.flavor,
                overrides=overrides,
                model_cfg=model_cfg,
                extra={
                    "trained_steps": final,
                    "experiment": cfg.experiment,
                    "cameras": cameras,
                    "image_hw": list(image_hw),
                },
            )
        result.export_dir = str(export_dir)
    if is_main and result.losses:
        log.info(
            "done: step %d/%d, loss %.4f -> %.4f over this run%s%s",
            result.steps_done,
            cfg.train.steps,
            result.losses[0],
            result.losses[-1],
            " (interrupted; resume with the same command)" if result.interrupted else "",
            f", policy exported to {result.export_dir}" if result.export_dir else "",
        )
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return result


class _StepWindow:
    """Wall time of the steps since the last log line, paused around checkpoint saves."""

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


def _is_zero(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)
