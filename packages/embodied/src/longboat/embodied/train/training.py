"""The embodied run for core's trainer: ``build_training(cfg)`` -> ``EmbodiedTraining``.

``build_training`` is the one assembly of an embodied run from the typed config; the command
line (``longboat-embodied train``) and the benchmarks both call it, so every speed lever is a
config key read here:

- data: the LeRobot dataset (``data.path``; null: the synthetic one, generated once into
  ``<output_dir>/dataset``), the ``PolicyCollator``, the ``GlobalBatchPlan`` of
  ``train.global_batch_size`` and this rank's ``RankMicroBatches`` loader
  (``data.num_workers``), rebuilt from any start step;
- the policy: ``model.*`` (the same initial weights on every rank), frozen as configured,
  ``parallelize``d (``parallel.strategy``, ``train.recompute``,
  ``train.master_weights``), its blocks compiled (``train.compile``), and its optimizer
  (``optim.*``, ``train.master_weight_storage``, ``train.master_weight_update``);
- the step: core's torch step engine (``longboat.core.engine.torch``): with master weights
  and one micro-batch a step, the sync-free ``GraphableStep`` (replayed as one CUDA graph
  with ``train.cuda_graph``) under ``LaggedGuard``; otherwise ``train_step`` (gradient
  accumulation) under core's synchronous gate. What stays here is the policy's: its config,
  data, batches, evaluation and export.

Core's ``Trainer`` owns everything around the steps (resume, signals, metrics, the LR schedule,
the NaN guard's counters, checkpoints, the profiler, the export call).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from longboat.core.config.errors import ProblemCollector
from longboat.core.data.batch_plan import BatchLayout, GlobalBatchPlan, batch_layout
from longboat.core.device import get_accelerator
from longboat.core.distributed import init_distributed, resolve_parallel
from longboat.core.engine.memory.report import MeasuredPeak
from longboat.core.engine.torch import engine
from longboat.core.engine.torch.graphable import run_step
from longboat.core.engine.torch.step import train_step
from longboat.core.loop.nan_guard import NaNGuard
from longboat.core.train.gate import UpdateGate
from longboat.core.train.trainer import typed_config
from longboat.core.train.training import StepOutput, Training
from longboat.embodied.config import (
    EmbodiedExperimentConfig,
    check_cuda_graph_layout,
    resolve_fast_path,
)
from longboat.embodied.eval.in_training import closed_loop_eval
from longboat.embodied.inference.processor import PolicyProcessor
from longboat.embodied.models import apply_freezing, build_model, hf_backbones
from longboat.embodied.models.init_from import load_initial_weights, resolve_model_config
from longboat.embodied.models.registry import policy
from longboat.embodied.parallel import (
    KNOWN_BLOCK_METHODS,
    MasterWeightAdamW,
    ParallelSetup,
    ZeroShardState,
    build_optimizer,
)
from longboat.embodied.train import lora
from longboat.embodied.train.datasets import ensure_synthetic, open_dataset
from longboat.embodied.train.evaluate import HeldOutEval
from longboat.embodied.train.export import export_policy
from longboat.embodied.train.loader import RankMicroBatches, build_loader
from longboat.embodied.train.memory_plan import plan_run_memory, resolve_storage
from longboat.embodied.train.plan import data_position, sample_plan
from longboat.embodied.train.policy_batch import (
    PolicyCollator,
    batch_spec,
    feature_limits,
    to_device,
)
from longboat.embodied.train.reference_formats import (
    checkpoint_statistics,
    plan_export,
    prompt_tokenizer,
    run_tokenizer,
    stand_in_tokenizer,
    write_export,
)

CUDA_GRAPH_WARMUP = engine.CUDA_GRAPH_WARMUP
"""Eager steps before ``train.cuda_graph`` captures the step."""


@dataclass
class RunData:
    """The run's dataset and how its samples become this rank's micro-batches."""

    root: Path
    """The LeRobot root trained on (``data.path`` or the generated synthetic dataset)."""
    dataset: Dataset
    cameras: list[str]
    image_hw: tuple[int, int]
    """The frame size of the batches: the cameras' own when they share one, else the model's
    image size (``resized``)."""
    collate: PolicyCollator
    plan: GlobalBatchPlan
    camera_sizes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """(height, width) of each camera in the dataset, one per sub-dataset."""
    resized: bool = False
    """The cameras differ in size: the collator resizes each to the model's image size."""
    bad_frames: int = 0
    """Frames skipped for values far outside stats.json (``data.skip_bad_samples``)."""
    verify_summary: str | None = None
    """The ``data.verify`` scan's summary line (None when off)."""
    eval_dataset: Dataset | None = None
    """The held-out episodes (``data.eval_episodes``); None: no held-out set."""
    held_out: list[list[int]] = field(default_factory=list)
    """The held-out episode indices of each sub-dataset."""
    norm_stats: list[dict[str, Any]] = field(default_factory=list)
    """The statistics each sub-dataset is normalised with."""
    stats_from_checkpoint: list[bool] = field(default_factory=list)
    """Per sub-dataset: those statistics are ``model.init_from``'s."""


def model_overrides(cfg: EmbodiedExperimentConfig, *, tokenizer: bool = False) -> dict[str, Any]:
    """``model.overrides`` as the family config gets them; ``tokenizer``: the prompts come
    from a Hugging Face tokenizer, so the policy takes its reference processor's inputs
    (``PromptProcessor.config_overrides``: e.g. pi0.5 LeRobot's, GR00T Isaac-GR00T's)."""
    overrides = dict(cfg.model.overrides)
    prompts = policy(cfg.model.name).prompts
    if tokenizer and prompts is not None:
        for key, value in prompts.config_overrides.items():
            overrides.setdefault(key, value)
    # fp32 runs keep frozen weights in fp32 too (the bf16 split is the reference's
    # mixed-precision layout; without autocast it would only cost accuracy).
    if cfg.train.precision == "fp32":
        overrides.setdefault("frozen_dtype", "float32")
    return overrides


def open_run_data(
    cfg: EmbodiedExperimentConfig,
    model_cfg: Any,
    layout: BatchLayout,
    is_main: bool,
    *,
    prompts: Any = None,
) -> RunData:
    """The dataset (synthetic on first use when ``data.path`` is null), its collator (prompts
    through ``prompts``, a Hugging Face tokenizer's, when given) and the global batch
    plan; a released ``model.init_from``'s statistics (e.g. Isaac-GR00T's) normalise the
    sub-datasets whose tag it knows."""
    root = (
        Path(cfg.data.path)
        if cfg.data.path
        else ensure_synthetic(cfg.data, cfg.model.name, model_cfg, Path(cfg.output_dir), is_main)
    )
    opened = open_dataset(
        cfg.data,
        root,
        model_cfg.action_horizon,
        limits=feature_limits(cfg.model.name, model_cfg),
        max_cameras=getattr(model_cfg, "num_cameras", None),
        is_main=is_main,
        stats_for=checkpoint_statistics(cfg),
    )
    sizes = opened.distinct_sizes
    resized = len(sizes) > 1
    spec = batch_spec(
        cfg.model.name, model_cfg, len(opened.cameras), sizes[0], resize_cameras=resized
    )
    collate = PolicyCollator(
        spec,
        opened.cameras,
        fixed_text_length=cfg.train.cuda_graph,  # one set of shapes for the graph
        prompts=prompts,
    )
    image_hw = spec.image_size if resized else sizes[0]
    plan = sample_plan(len(opened.dataset), layout, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    return RunData(
        root,
        opened.dataset,
        opened.cameras,
        tuple(image_hw),
        collate,
        plan,
        camera_sizes=opened.camera_sizes,
        resized=resized,
        bad_frames=opened.bad_frames,
        verify_summary=opened.verify.summary() if opened.verify is not None else None,
        eval_dataset=opened.eval_dataset,
        held_out=opened.held_out,
        norm_stats=opened.norm_stats,
        stats_from_checkpoint=opened.stats_from_checkpoint,
    )


def build_run_model(
    cfg: EmbodiedExperimentConfig,
    model_cfg: Any,
    *,
    initial_weights: bool = True,
    verbose: bool = False,
) -> tuple[nn.Module, dict[str, int]]:
    """The run's policy on the CPU, before parallelism: built from ``train.seed``,
    ``model.init_from``'s weights loaded (``initial_weights``), frozen as configured, its LoRA
    adapters added; its parameters then have the names and dtypes of the run's checkpoint.
    Returns it with its trainable / frozen parameter counts."""
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    model = build_model(cfg.model.name, model_cfg)
    if cfg.model.init_from and initial_weights:
        loaded = load_initial_weights(model, cfg.model.name, cfg.model.init_from)
        if loaded and verbose:
            print(loaded, flush=True)  # a backbone alone: which parts stay initialised
    counts = apply_freezing(model, model_cfg)
    if cfg.lora.enabled:  # only the adapters train (train/lora.py)
        counts = lora.apply_run_lora(model, cfg)
    return model, counts


def build_policy(
    cfg: EmbodiedExperimentConfig,
    model_cfg: Any,
    setup: ParallelSetup,
    accelerator: Any,
    device: Any,
) -> tuple[nn.Module, dict[str, int]]:
    """The policy on its device: frozen as configured, parallelized, its blocks compiled
    (``train.compile``); and its trainable / frozen parameter counts."""
    model, counts = build_run_model(cfg, model_cfg, verbose=setup.rank == 0)
    model.to(device)
    model, compiled = engine.prepare_model(
        model,
        setup,
        accelerator,
        device,
        precision=cfg.train.precision,
        recompute=cfg.train.recompute or "none",
        compile=cfg.train.compile,
        master_weights=cfg.train.master_weights,
        known_block_methods=KNOWN_BLOCK_METHODS,
    )
    if cfg.train.compile:
        counts["compiled_blocks"] = compiled
    return model, counts


def build_step_fn(
    cfg: EmbodiedExperimentConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: BatchLayout,
    accelerator: Any,
    *,
    eager_on_sync: bool = False,
) -> Any:
    """The sync-free step of master weights with one micro-batch a step (``GraphableStep``,
    graphed with ``train.cuda_graph``); None: the run steps through ``train_step``.
    ``eager_on_sync``: a host sync found before the capture turns the graph off (warned)
    instead of failing the run."""
    problems = ProblemCollector()
    check_cuda_graph_layout(
        cfg.train, layout.dp_size, problems, stack="embodied"
    )  # the resolved dp size
    problems.raise_if_any()
    return engine.build_step_fn(
        model,
        optimizer,
        accelerator,
        accum=layout.accum,
        precision=cfg.train.precision,
        grad_clip=cfg.optim.grad_clip,
        # The device skips a non-finite loss exactly when the guard would.
        skip_nonfinite_loss=cfg.train.nan_guard.enabled,
        cuda_graph=cfg.train.cuda_graph,
        eager_on_sync=eager_on_sync,
        name="embodied train step",
    )


def plan_memory(run: EmbodiedTraining, strategy: str) -> Any:
    """The run's memory plan (``memory_plan.plan_run_memory``; a str where nothing was
    planned), its choices written back: ``train.recompute`` and, split, the micro-batch
    (with the layout and the sample plan rebuilt for it)."""
    cfg, t = run.cfg, run.cfg.train
    master = resolve_fast_path(t, strategy=strategy, optim_name=cfg.optim.name,
                               device_type=run.accelerator.device_type, accum=run.layout.accum,
                               dp_size=run.layout.dp_size).master_weights  # fmt: skip
    plan = plan_run_memory(cfg, run.model_cfg, run.data, run.layout, run.accelerator,
                           master_weights=master, strategy=strategy)  # fmt: skip
    if isinstance(plan, str):
        t.recompute = t.recompute or "none"
        resolve_storage(cfg, None)
        return plan
    resolve_storage(cfg, plan)
    t.recompute = plan.choice.recompute
    if plan.choice.micro_batch != t.micro_batch_size:
        t.micro_batch_size = plan.choice.micro_batch
        layout = run.layout
        run.layout = batch_layout(layout.global_batch, t.micro_batch_size, layout.dp_size)
        run.data.plan = sample_plan(
            len(run.data.dataset), run.layout, seed=cfg.data.seed, shuffle=cfg.data.shuffle
        )
    return plan


class EmbodiedTraining(Training):
    """An embodied run for core's ``Trainer`` (module doc); ``build_training`` builds it."""

    unit = "samples"
    resume_keys = ("model.name", "model.flavor", "train.master_weights")
    """A master-weight checkpoint holds another optimizer state than an autocast one (the
    resolved value is saved, so a run resumes in the layout it started in)."""

    def __init__(self, cfg: EmbodiedExperimentConfig) -> None:
        self.cfg = cfg
        self.accelerator = get_accelerator()
        info = init_distributed(self.accelerator)
        self.is_main = info.is_main
        self.rank = info.rank  # embodied is data parallel only: dp rank == global rank
        self.device = self.accelerator.device(info.local_rank)
        parallel = resolve_parallel(cfg.parallel, info.world_size)
        t = cfg.train
        self.layout = batch_layout(t.global_batch_size, t.micro_batch_size, parallel.data_parallel)
        self.items_per_step = self.layout.global_batch
        self.tokenizer_dir = run_tokenizer(cfg) or stand_in_tokenizer(cfg, self.is_main)
        self.overrides = model_overrides(cfg, tokenizer=self.tokenizer_dir is not None)
        self.model_cfg = resolve_model_config(
            cfg.model.name, cfg.model.flavor, self.overrides, cfg.model.init_from
        )
        self.prompts = (
            prompt_tokenizer(self.tokenizer_dir, cfg.model.name, self.model_cfg)
            if self.tokenizer_dir
            else None
        )
        self.data = open_run_data(
            cfg, self.model_cfg, self.layout, self.is_main, prompts=self.prompts
        )
        # The memory plan (train.memory_budget): train.recompute (null) and the micro-batch,
        # before the levers that depend on them are resolved.
        self.memory_plan = plan_memory(self, parallel.strategy)
        # null master weights / CUDA graph: on where they apply (written back, so every
        # piece below reads the run's resolved values).
        self.fast_path = resolve_fast_path(
            t,
            strategy=parallel.strategy,
            optim_name=cfg.optim.name,
            device_type=self.accelerator.device_type,
            accum=self.layout.accum,
            dp_size=self.layout.dp_size,
        )
        t.master_weights = self.fast_path.master_weights
        t.cuda_graph = self.fast_path.cuda_graph
        self.data.collate.fixed_text_length = bool(t.cuda_graph)  # one set of shapes
        self.export_format, self.export_skipped = plan_export(
            cfg, self.model_cfg, len(self.data.norm_stats)
        )
        self.reference_export: Path | None = None
        self.sim_eval = closed_loop_eval(cfg, self.data, self.is_main)
        self.position = data_position(self.data.plan, self.data.held_out)
        self.setup = ParallelSetup.from_config(
            parallel,
            world_size=info.world_size,
            rank=info.rank,
            device_type=self.accelerator.device_type,
        )
        self.model, self.counts = build_policy(
            cfg, self.model_cfg, self.setup, self.accelerator, self.device
        )
        self.optimizer = build_optimizer(
            self.model,
            cfg.optim,
            self.setup,
            master_weights=t.master_weights,
            master_storage=t.master_weight_storage,
            master_update=t.master_weight_update,
            master_seed=t.seed,
        )
        self.step_fn = build_step_fn(
            cfg,
            self.model,
            self.optimizer,
            self.layout,
            self.accelerator,
            eager_on_sync=self.fast_path.graph_auto,
        )
        self.ema = None
        """The weights' ``EMAWeights`` (``ema.enabled``; None: off): the average of the weights
        the policy computes with (with master weights, their bf16 copies), kept in fp32."""
        if cfg.ema.enabled:
            from longboat.core.train.ema import EMAWeights

            self.ema = EMAWeights(dict(self.model.named_parameters()), cfg.ema)
        self.steps_done = 0
        self.held_out_eval = None
        if self.data.eval_dataset is not None:
            self.held_out_eval = HeldOutEval(
                self.data.eval_dataset,
                self.data.collate,
                max_batches=cfg.data.eval_batches,
                micro_batch=t.micro_batch_size,
                seed=t.seed,
                precision=t.precision,
                device=self.device,
                rank=self.rank,
                world_size=info.world_size,
            )

    # --- what the trainer checkpoints and schedules ----------------------------------------

    def state(self) -> dict[str, Any]:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer: Any = self.optimizer
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer = ZeroShardState(optimizer)  # each rank's partition
        state = {"model": self.model, "optimizer": optimizer, "data": self.position}
        if self.ema is not None:
            state["ema"] = self.ema  # per rank: each holds the average of what it holds
        return state

    def optimizers(self) -> list[Any]:
        return [self.optimizer]

    def make_gate(self, guard: NaNGuard, schedule: Any) -> UpdateGate:
        """``LaggedGuard`` for the sync-free step (no host read per step), else core's
        synchronous gate."""
        return engine.make_gate(
            guard,
            schedule,
            step_fn=self.step_fn,
            optimizer=self.optimizer,
            accum=self.layout.accum,
            total_steps=self.cfg.train.steps,
            accelerator=self.accelerator,
        )

    def after_resume(self, step: int) -> None:
        self.steps_done = step

    def callbacks(self) -> list[Any]:
        """The memory plan's measured-peak line after the first steps (where it planned)."""
        if isinstance(self.memory_plan, str):
            return []
        return [MeasuredPeak(self.accelerator, self.memory_plan)]

    # --- the steps ---------------------------------------------------------------------------

    def batches(self, start_step: int) -> Iterator[list[dict[str, Any]]]:
        """This rank's ``accum`` micro-batches of every step from ``start_step`` on, on the
        device. The loader (and its workers) starts at once, so batches load while the
        trainer sets up."""
        if start_step >= self.cfg.train.steps:
            return iter(())  # resumed at train.steps: nothing to load
        data = self.data
        micro = RankMicroBatches(
            data.dataset, data.plan, data.collate, dp_rank=self.rank, seed=self.cfg.train.seed
        )
        loader = build_loader(
            micro,
            start_step=start_step,
            total_steps=self.cfg.train.steps,
            num_workers=self.cfg.data.num_workers,
            pin_memory=self.accelerator.device_type == "cuda",
        )
        return self._device_batches(iter(loader), self.cfg.train.steps - start_step)

    def _device_batches(self, it: Iterator[Any], steps: int) -> Iterator[list[dict[str, Any]]]:
        for _ in range(steps):
            yield [to_device(next(it), self.device) for _ in range(self.layout.accum)]

    def step(self, step: int, batch: list[dict[str, Any]], gate: UpdateGate) -> StepOutput:
        """One optimizer step on this rank's micro-batches; reads nothing on the host under
        ``LaggedGuard``."""
        common: dict[str, Any] = dict(
            step=step,
            seed=self.cfg.train.seed,
            rank_offset=self.rank * self.layout.accum,
            device_type=self.accelerator.device_type,
            device_index=self.device.index,
            gate=gate,
            host_sync=False,  # losses stay on the device until the trainer logs them
        )
        if self.step_fn is not None:
            out = run_step(self.step_fn, self.optimizer, batch[0], **common)
        else:
            out = train_step(
                self.model,
                self.optimizer,
                batch,
                precision=self.cfg.train.precision,
                grad_clip=self.cfg.optim.grad_clip,
                **common,
            )
        self.steps_done = step + 1
        if self.ema is not None:
            self.ema.update(step + 1)
        return StepOutput(loss=out.loss, grad_norm=out.grad_norm, metrics=out.metrics)

    def evaluate(self) -> dict[str, float]:
        """``eval_loss`` and ``eval_action_mse`` on the held-out episodes (``HeldOutEval``,
        with ``data.eval_episodes``) and ``sim_success_rate`` in simulation (with
        ``train.sim_eval.suite``, after the first evaluation)."""
        row = {} if self.held_out_eval is None else self.held_out_eval.run(self.model)
        if self.sim_eval is not None:
            row.update(self.sim_eval.run(self.steps_done, self.write_policy))
        return row

    # --- the end -----------------------------------------------------------------------------

    def export(self) -> Path | None:
        """``model.safetensors`` + ``config.json`` (``export.dir``, default
        ``<output_dir>/export``) and the processor (``processor.json``, the tokenizer in
        ``tokenizer/``); with master weights, the fp32 masters (the trained values), not their
        bf16 copy; with ``ema.export``, the fp32 average of the weights. Every rank takes part (the weights are gathered). Then, on rank
        0, the reference format of ``export.format`` in ``<dir>/lerobot`` or ``<dir>/isaac``."""
        cfg = self.cfg
        if not cfg.export.enabled:
            return None
        out = Path(cfg.export.dir) if cfg.export.dir else Path(cfg.output_dir) / "export"
        self.write_policy(out, adapter=True)
        if self.export_format != "native":
            if self.is_main:  # from the files just written: one process, no collective
                self.reference_export = write_export(
                    cfg.model.name,
                    self.export_format,
                    out,
                    root=self.data.root,
                    tokenizer=self.tokenizer_dir,
                    cameras=self.data.cameras,
                    stats=self.data.norm_stats,
                )
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier()
        return out

    def write_policy(self, out: Path, *, adapter: bool = False) -> None:
        """The native export of the current weights into ``out`` (what ``load_policy``
        reads; every rank takes part); ``adapter``: also the LoRA adapter folder."""
        cfg = self.cfg
        masters = (
            self.optimizer.master_params()
            if isinstance(self.optimizer, MasterWeightAdamW)
            else contextlib.nullcontext()
        )
        averaged = (
            self.ema.swapped()
            if self.ema is not None and cfg.ema.export
            else contextlib.nullcontext()
        )
        merge = None
        if cfg.lora.enabled:  # LoRA merged into the base weights of the gathered state
            scales = lora.lora_scales(self.model)
            merge = functools.partial(lora.merge_lora_state, scales=scales)
        # the average (ema.export) in place of the trained weights
        with masters, averaged:
            if adapter and cfg.lora.enabled:  # the adapters alone (every rank: gathered)
                lo = cfg.lora
                lora.save_peft_adapter(self.model, lora.adapter_dir(cfg), rank=lo.rank,
                                       alpha=lo.alpha, dropout=lo.dropout,
                                       base_model=cfg.model.init_from)  # fmt: skip
            export_policy(
                self.model,
                out,
                model_name=cfg.model.name,
                flavor=cfg.model.flavor,
                overrides=self.overrides,
                model_cfg=self.model_cfg,
                extra={
                    "trained_steps": self.steps_done,
                    "experiment": cfg.experiment,
                    "cameras": self.data.cameras,
                    "image_hw": list(self.data.image_hw),
                    "init_from": cfg.model.init_from,
                    "tokenizer": str(self.tokenizer_dir) if self.tokenizer_dir else None,
                },
                transform=merge,
            )
        if self.is_main:  # what acting on raw observations needs (load_policy)
            PolicyProcessor.from_run(
                cfg.model.name,
                self.data.collate,
                self.data.norm_stats,
                tokenizer=self.tokenizer_dir,
                precision=cfg.train.precision,
                model_overrides=self.overrides,
            ).save(out)

    def describe(self) -> list[str]:
        cfg, layout, counts = self.cfg, self.layout, self.counts
        h, w = self.data.image_hw
        how = engine.describe_step(self.step_fn)
        compiled = counts.get("compiled_blocks")
        data = self.data
        if data.resized:
            each = ", ".join(
                f"{cam.rsplit('.', 1)[-1]} {'/'.join(f'{a}x{b}' for a, b in sizes)}"
                for cam, sizes in data.camera_sizes.items()
            )
            fit = "resized with padding" if data.collate.spec.pad_to_size else "resized"
            frames = f"{each}; each {fit} to the model's {h}x{w}"
        else:
            frames = f"{h}x{w}"
        policy = f"{cfg.model.name}/{cfg.model.flavor}"
        if cfg.model.init_from and not hf_backbones.is_hf_backbone(cfg.model.init_from):
            # A released checkpoint brings its own architecture: model.flavor is not used.
            policy = f"{cfg.model.name} from {cfg.model.init_from} (its architecture and weights)"
        lines = [
            f"Policy {policy}: {counts['trainable']:,} trainable + "
            f"{counts['frozen']:,} frozen params, {cfg.train.precision}"
            + (f", {compiled} blocks torch.compile'd" if compiled else "")
            + f"; step: {how}.",
            f"Data: {data.root} ({len(data.dataset)} samples, cameras "
            f"{', '.join(data.cameras)}, {frames}); global batch {layout.global_batch} = "
            f"{layout.micro_batch} micro x {layout.dp_size} dp x {layout.accum} accum, "
            f"{self.setup.strategy} on {self.setup.world_size} rank(s).",
        ]
        if self.held_out_eval is not None:
            parts = [", ".join(map(str, eps)) or "none" for eps in data.held_out]
            held = parts[0] if len(parts) == 1 else " / ".join(parts) + " (per sub-dataset)"
            if len(parts) > 1 and len(set(parts)) == 1:
                held = f"{parts[0]} of each of the {len(parts)} sub-datasets"
            ev = self.held_out_eval
            every = cfg.train.eval_every
            when = f"every {every} steps, " if every > 0 else ""
            lines.append(
                f"Held out (data.eval_episodes): episodes {held} ({len(ev.dataset)} samples); "
                f"evaluated {when}at the start and the end on {len(ev.batches)} batch(es), "
                f"{ev.num_samples} samples (eval_loss, eval_action_mse)."
            )
        if self.sim_eval is not None:
            lines.append(self.sim_eval.describe())
        lines.extend(self.fast_path.notices)
        plan = self.memory_plan
        lines.append(plan if isinstance(plan, str) else plan.line())
        lines.append(self._prompt_line())
        if any(data.stats_from_checkpoint):
            which = [i for i, used in enumerate(data.stats_from_checkpoint) if used]
            lines.append(
                f"Normaliser: the statistics.json of model.init_from for sub-dataset(s) {which} "
                "(their embodiment tag has statistics there); the rest from meta/stats.json."
            )
        if self.export_skipped:
            lines.append(f"Export: native only (export.format=auto): {self.export_skipped}.")
        if data.bad_frames:
            lines.append(
                f"Data: skipping {data.bad_frames} frame(s) with values far outside "
                "meta/stats.json (data.skip_bad_samples=true; the warning names them)."
            )
        if data.verify_summary:
            lines.append(data.verify_summary)
        if self.ema is not None:
            lines.append(self.ema.describe())
        if cfg.lora.enabled:
            lines.append(lora.describe_lora(self.model, cfg))
        return lines

    def _prompt_line(self) -> str:
        if self.prompts is not None:
            return self.prompts.describe()
        prompts = policy(self.cfg.model.name).prompts
        if prompts is None:
            return "Prompts: task text through the byte-level stand-in tokenizer (ByteTokenizer)."
        wanted = prompts.hint
        if self._pretrained_lm():  # only where that LM may have learnt the stand-in's ids
            return (
                "Prompts: task text through the byte-level stand-in tokenizer (ByteTokenizer), "
                "read by model.init_from's language model: right only for a checkpoint trained "
                f"on these ids (a longboat run without model.tokenizer); {wanted}."
            )
        return (
            "Prompts: task text through the byte-level stand-in tokenizer (ByteTokenizer; "
            f"from-scratch runs only, no pretrained language model reads its ids); {wanted}."
        )

    def _pretrained_lm(self) -> bool:
        """``model.init_from`` brings language-model weights (a released checkpoint, or a
        Hugging Face backbone with its LM)."""
        init_from = self.cfg.model.init_from
        if not init_from:
            return False
        if not hf_backbones.is_hf_backbone(init_from):
            return True
        return "llm" in hf_backbones.read_backbone(init_from, self.cfg.model.name).kind.prefixes

    def report(self, result: Any) -> list[str]:
        if result.export_dir is None:
            return []
        lines = [f"Policy:      {result.export_dir} (inference.load_policy acts with it)"]
        chosen = policy(self.cfg.model.name).export_format(self.export_format)
        if self.reference_export is not None and chosen is not None:
            lines.append(f"{chosen.label}: {self.reference_export} ({chosen.loaded_by})")
        if self.cfg.lora.enabled:
            where = lora.adapter_dir(self.cfg)
            lines.append(f"LoRA:        {where} (peft.PeftModel.from_pretrained loads it)")
        return lines


def build_training(cfg: Any) -> EmbodiedTraining:
    """The embodied run of a composed, validated config (a DictConfig or the typed
    ``EmbodiedExperimentConfig``): what ``longboat-embodied train`` and the benchmarks run."""
    cfg = typed_config(cfg)
    if not isinstance(cfg, EmbodiedExperimentConfig):
        raise TypeError(
            "build_training needs an EmbodiedExperimentConfig (compose one with "
            f"longboat.core.config.compose.compose_experiment), got {type(cfg).__name__}"
        )
    return EmbodiedTraining(cfg)


__all__ = [
    "EmbodiedTraining",
    "RunData",
    "build_policy",
    "build_run_model",
    "build_step_fn",
    "build_training",
    "model_overrides",
    "open_run_data",
]
