"""``longboat-vlm train``: the VLM stack's run on core's trainer.

``build_training(cfg)`` is the stack's one assembly (the command line and benchmarks call
it): the process group (a one-rank group when not launched by torchrun), the data
(conversations read, encoded with the tokenizer's chat template and the model's vision
processor, packed into rows of ``data.seq_len`` tokens; the quickstart generates its own),
megatron's parallel state, the model (from its flavor or ``model.init_from``), and the
step on megatron's DDP + distributed optimizer (``VLMTrainStep``). The rows of every step
are a pure function of the step (core's global batch plan, ``data.row_plan``), so a resumed
run sees exactly the rows the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longboat.core.config.errors import ConfigError
from longboat.core.device.transfer import batch_to_device
from longboat.core.distributed import run_precision, split_fp8
from longboat.core.megatron.training import MegatronTraining
from longboat.core.train import (
    RunResult,
    StepOutput,
    UpdateGate,
    run_training,
    typed_config,
)
from longboat.vlm.train.pipeline import check_pipeline

RESUME_KEYS = (
    "parallel.tensor_parallel",
    "parallel.pipeline_parallel",
    "parallel.expert_parallel",
    "model.vision_tensor_parallel",
    "model.name",
    "model.flavor",
    "model.init_from",
    "model.freeze",
    "data.seq_len",
    "lora.enabled",
    "lora.rank",
    "lora.targets",
)
"""What a checkpoint's sharded model and optimizer state depend on."""


def model_family(cfg: Any) -> Any:
    """The run's ``VLMFamily``: the checkpoint's (its ``model_type``) with
    ``model.init_from``, else ``model.name``'s."""
    from longboat.vlm.models.registry import family_of_hf_dir, get_family

    if cfg.model.init_from:
        return family_of_hf_dir(cfg.model.init_from)
    return get_family(cfg.model.name)


def model_config(cfg: Any) -> Any:
    """The model config of the run: the checkpoint's with ``model.init_from``, else the
    flavor's (the tokenizer's token ids are set later, with the data)."""
    family = model_family(cfg).load()
    sections = [k for k in ("vision", "projector", "language") if getattr(cfg.model, k, None)]
    compose = getattr(family, "from_model_config", None)
    if sections and (compose is None or cfg.model.init_from):
        raise ConfigError(
            "composes a model, but "
            + ("model.init_from gives the architecture" if compose else
               f"model.name={cfg.model.name} is not a composed family"),
            key=f"model.{sections[0]}",
            fix="drop model.vision / model.projector / model.language, or use a composed "
            "family (model=llava_onevision_tiny)",
        )  # fmt: skip
    if cfg.model.init_from:
        return family.read_hf_config(cfg.model.init_from)
    if compose is not None:
        return compose(cfg.model)
    return family.flavor(cfg.model.flavor)


def check_moe_layout(parallel: Any, model_cfg: Any) -> None:
    """Refuse tensor parallelism under an MoE decoder (before the data and the model are
    built): megatron trains MoE layers under TP only with sequence parallelism, which the
    vlm stack does not run; the experts split over ``parallel.expert_parallel`` instead."""
    if model_cfg.language.num_experts and parallel.tensor_parallel > 1:
        raise ConfigError(
            "an MoE decoder trains under tensor parallelism only with sequence parallelism, "
            "which longboat-vlm does not run",
            key="parallel.tensor_parallel",
            value=parallel.tensor_parallel,
            fix="set it to 1 and split the experts with parallel.expert_parallel",
        )


def recompute_components(train: Any) -> tuple[str, ...]:
    """The components whose activations are recomputed (``train.recompute=full``: each ViT
    block of ``vision``, each decoder layer of ``language``; ``train.recompute_components``
    picks some, null: both). ``train.recompute`` null (not planned yet): none."""
    from longboat.vlm.models.common import RECOMPUTE_COMPONENTS

    if train.recompute in (None, "none"):
        return ()
    return tuple(train.recompute_components or RECOMPUTE_COMPONENTS)


def build_run_model(
    cfg: Any,
    family: Any,
    model_cfg: Any,
    precision: str,
    device_type: str,
    fp8_recipe: str | None = None,
) -> tuple[Any, Any, Any]:
    """``(model, model config, layer kernels)``: the run's VLM built as its training builds
    it (``model.layer_backend``, longboat's layer kernels, recompute, vision tensor
    parallelism), with fresh weights; ``family`` is the loaded family module.
    ``fp8_recipe`` (``train.fp8.recipe`` of a ``train.precision=fp8`` run, ``precision`` then
    the weights' bf16): the language decoder's linears and grouped MoE experts run their GEMMs
    in FP8 (its first and last layers, the vision tower, projector, embeddings and head in
    bf16); on a device without FP8 matmuls they are emulated (tests: the command line refuses
    such a device)."""
    from longboat.kernels.layers import longboat_layer_kernels

    mcfg = dataclasses.replace(
        model_cfg,
        language=dataclasses.replace(model_cfg.language, layer_backend=cfg.model.layer_backend),
    )
    # M-RoPE angles differ per token: megatron's rotation, not the 1D-position kernels;
    # a decoder with 1D positions (composed families) takes the fast rotary kernels too.
    if fp8_recipe is not None:
        from longboat.core.megatron.specs import check_fp8_layer_backend

        check_fp8_layer_backend(mcfg.language.layer_backend, device_type)
    if mcfg.language.mrope_section is None:
        kernels = longboat_layer_kernels(fp8=fp8_recipe)
    else:
        kernels = longboat_layer_kernels(rope=False, qkv_rope=False, fp8=fp8_recipe)
    model = family.build(
        mcfg,
        precision=precision,
        device_type=device_type,
        kernels=kernels,
        recompute=recompute_components(cfg.train),
        vision_tensor_parallel=cfg.model.vision_tensor_parallel,
    )
    if fp8_recipe is not None:  # FP8 is the decoder's: the tower and projector stay in bf16
        from longboat.core.megatron.linears import run_high_precision

        for name, child in model.named_children():
            if name != "language":
                run_high_precision(child)
    return model, mcfg, kernels


HOST_KEYS = frozenset({"image_grid_thw", "video_grid_thw"})
"""Row entries that stay on the host: the towers plan their packing from the grids there, so
a grid on the device would be read back every step."""


def exact_main_weights(
    optimizer: Any,
    model: torch.nn.Module,
    family: Any,
    mcfg: Any,
    hf_dir: str,
    precision: str,
    **build: Any,
) -> int:
    """Start the fp32 main weights of a bf16 / fp16 run from an HF checkpoint's fp32 values
    instead of their rounding in ``model``; returns how many parameters were set (0: the
    precision is fp32 or the checkpoint holds no fp32 tensor).

    The values come from an fp32 copy of this rank's model built on the host and loaded from
    ``hf_dir`` (``family.build(mcfg, precision="fp32", **build)``, ``family.load_hf``), so
    every family's name mapping and sharding applies. Started from the rounded weights, the
    first updates (smaller than half a bf16 step early in an LR warm-up) leave the model's
    weights where they are until they add up to one."""
    from longboat.core.megatron.optimizer import checkpoint_above_precision, start_main_weights

    if not checkpoint_above_precision(hf_dir, precision):
        return 0
    shadow = family.build(mcfg, precision="fp32", device_type="cpu", **build)
    family.load_hf(shadow, mcfg, hf_dir)
    values = {name: p.detach() for name, p in shadow.named_parameters()}
    try:
        return start_main_weights(optimizer, model, values)
    finally:
        del shadow, values


class VLMTraining(MegatronTraining):
    """One ``longboat-vlm train`` run, built (see the module doc)."""

    unit = "tokens"
    resume_keys = RESUME_KEYS

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg, num_threads=cfg.vlm.num_threads)

    def check(self, cfg: Any) -> None:
        if cfg.train.micro_batch_size != 1:
            raise ConfigError(
                "a VLM microbatch is one packed row",
                key="train.micro_batch_size",
                value=cfg.train.micro_batch_size,
                fix="set it to 1 and pack more tokens per row with data.seq_len",
            )
        if cfg.lora.enabled and cfg.lora.rank < 1:
            raise ConfigError("must be >= 1", key="lora.rank", value=cfg.lora.rank)
        if cfg.lora.enabled and "language" in cfg.model.freeze:
            raise ConfigError(
                "freezes the language model that lora.enabled=true trains adapters on",
                key="model.freeze",
                value=list(cfg.model.freeze),
                fix="remove language from model.freeze (LoRA freezes the decoder's base weights)",
            )
        adapter = cfg.export.adapter_dir  # without LoRA: refused at validation (lora.py)
        if adapter is not None and cfg.lora.enabled:
            from longboat.vlm.train.lora import adapter_export_problem

            family = model_family(cfg)
            problem = adapter_export_problem(family.load(), cfg.model.freeze)
            if problem is not None:
                why, fix = problem
                raise ConfigError(
                    f"the {family.name} family {why}",
                    key="export.adapter_dir",
                    value=adapter,
                    fix=f"{fix}leave export.adapter_dir null (the export has the adapters merged)",
                )
        if cfg.model.vision_tensor_parallel is not None:
            from longboat.vlm.models.vision_parallel import resolve_vision_tensor_parallel

            family = model_family(cfg)
            resolve_vision_tensor_parallel(
                cfg.model.vision_tensor_parallel,
                cfg.parallel.tensor_parallel,
                cfg.parallel.pipeline_parallel,
                family=family.name,
                supported=getattr(family.load(), "VISION_DATA_PARALLEL", False),
            )
        from longboat.vlm.train.step import check_lr_scale

        check_lr_scale(cfg.model.lr_scale, cfg.model.freeze)
        if cfg.data.name != "shapes" and not cfg.data.paths:
            raise ConfigError(
                "no conversation files given",
                key="data.paths",
                fix="data.paths=[file.jsonl, ...] (LLaVA / ShareGPT JSON, JSONL or Parquet)",
            )

    def _build(self, rank: int) -> None:
        from megatron.core import parallel_state as mps

        from longboat.core.data.batch_plan import batch_layout
        from longboat.core.rng import seed_everything
        from longboat.vlm.train.data import open_run_data, row_plan

        cfg = self.cfg
        self.family = model_family(cfg)
        self.model_cfg = model_config(cfg)
        check_pipeline(cfg.parallel, self.model_cfg, tuple(cfg.model.freeze), family=self.family)
        check_moe_layout(cfg.parallel, self.model_cfg)
        progress = self.is_main and cfg.logging.progress
        self.data = open_run_data(cfg, self.model_cfg, progress=progress)
        self.model_cfg = self.data.model_cfg
        precision = run_precision(cfg.train.precision, cfg.vlm.cpu_precision, self.accelerator)
        self.precision, self.fp8_recipe = split_fp8(precision, cfg.train.fp8.recipe)
        self.init_layout(cfg.parallel, cfg.train.seed)
        self.memory_plan = self.plan_memory()
        dp = self.layout.data_parallel
        batches = batch_layout(cfg.train.global_batch_size, cfg.train.micro_batch_size, dp)
        self.global_batch = batches.global_batch
        self.items_per_step = batches.global_batch * self.data.train.seq_len
        self.dp_rank, self.dp = mps.get_data_parallel_rank(), dp
        self.device = self.accelerator.device()
        workers = cfg.data.num_workers
        if workers is None:  # the host builds rows while the accelerator trains
            workers = 0 if self.accelerator.device_type == "cpu" else min(4, os.cpu_count() or 1)
        self.data_workers = workers
        self.row_costs = None
        if dp > 1 and cfg.vlm.dp_balance:
            from longboat.vlm.train.balance import row_costs

            self.row_costs = row_costs(self.data.train, self.model_cfg)
        self.plan = row_plan(len(self.data.train), batches, cfg.data.seed, self.row_costs)
        seed_everything(cfg.train.seed, self.accelerator)
        self.step_fn = self._build_step()
        self.ddp_modules = [self.step_fn.ddp]

    def plan_memory(self) -> Any:
        """The run's memory plan over the vision tower and the decoder
        (``train.memory.plan_vlm_memory``), its ``train.recompute`` written back."""
        from longboat.vlm.train.memory import plan_vlm_memory

        return plan_vlm_memory(self)

    def callbacks(self) -> list[Any]:
        """The memory plan's measured-peak line after the first steps (where it planned)."""
        from longboat.core.engine.memory.report import MeasuredPeak

        if isinstance(self.memory_plan, str):
            return []
        return [MeasuredPeak(self.accelerator, self.memory_plan)]

    def _build_step(self) -> Any:
        from longboat.kernels import adamw_master_step_
        from longboat.vlm.train.step import VLMTrainStep

        cfg = self.cfg
        family = self.family.load()
        model, mcfg, kernels = build_run_model(
            cfg, family, self.model_cfg, self.precision, self.accelerator.device_type,
            fp8_recipe=self.fp8_recipe,
        )  # fmt: skip
        if cfg.model.init_from:
            family.load_hf(model, mcfg, cfg.model.init_from)
        step = VLMTrainStep(
            model,
            cfg.optim,
            precision=self.precision,
            frozen=tuple(cfg.model.freeze),
            lr_scale=dict(cfg.model.lr_scale),
            lora=cfg.lora,
            seed=cfg.train.seed,
            cuda_graph=cfg.train.cuda_graph is not False,
        )
        self.fp8_table = ""
        if self.fp8_recipe == "adaptive":  # FP8 or bf16 per decoder linear, measured here
            from longboat.kernels.fp8.model import decide_adaptive

            tokens = self.data.train.seq_len * cfg.train.micro_batch_size
            self.fp8_table = decide_adaptive([model.language], tokens, self.device)
        step.static_shapes_blocker = self._graph_shapes_blocker()
        step.use_one_pass(
            "auto" if cfg.optim.one_pass_adamw else False,
            adamw_master_step_,
            cfg.optim.moment_dtype,
        )
        self.exact_main_weights = 0
        """Main weights started from the checkpoint's fp32 values (``exact_main_weights``)."""
        if cfg.model.init_from and not cfg.lora.enabled:
            self.exact_main_weights = exact_main_weights(
                step.optimizer, model, family, mcfg, cfg.model.init_from, self.precision,
                kernels=kernels, vision_tensor_parallel=cfg.model.vision_tensor_parallel,
            )  # fmt: skip
        return step

    def _graph_shapes_blocker(self) -> str | None:
        """Why the rows change shape between steps, if they do (``train.cuda_graph`` replays
        one set): a row's shapes and host values follow its samples' images and videos and
        how many samples it packs."""
        rows = self.data.train
        shapes = set()
        for pieces in rows.rows:
            media = tuple(
                (
                    tuple(map(tuple, rows.samples[p.doc].image_grid_thw.tolist())),
                    tuple(map(tuple, rows.samples[p.doc].video_grid_thw.tolist())),
                )
                for p in pieces
            )
            full = sum(p.stop - p.start for p in pieces) == rows.seq_len
            shapes.add((media, full))
            if len(shapes) > 1:
                return (
                    "rows of different images, videos or sample counts (a graph replays one "
                    "set of shapes)"
                )
        return None

    # --- what the trainer needs ----------------------------------------------------------

    def state(self) -> dict[str, Any]:
        from longboat.core.megatron.optimizer import MegatronOptimizerState

        return {
            "model": self._checkpoint_module(),
            "optimizer": MegatronOptimizerState(self.step_fn.optimizer),
        }

    def optimizers(self) -> list[Any]:
        from longboat.core.megatron.optimizer import inner_optimizers

        return inner_optimizers(self.step_fn.optimizer)

    def rows_of_rank(self, step: int) -> list[int]:
        """The packed rows this rank trains on at ``step`` (a pure function of the step)."""
        return [i for micro in self.plan.rank_micro_batches(step, self.dp_rank) for i in micro]

    def batches(self, start_step: int) -> Iterator[list[dict[str, Any]]]:
        """This rank's rows of every step from ``start_step``, built ahead of the training
        loop by ``data.num_workers`` loader processes (images decoded and resized there) and
        pinned for asynchronous copies on an accelerator."""
        from longboat.core.data.step_loader import step_batches

        rows = self.data.train
        return step_batches(
            lambda step: [rows[i] for i in self.rows_of_rank(step)],
            start_step,
            num_workers=self.data_workers,
            pin_memory=self.accelerator.device_type == "cuda",
        )

    def balance_summary(self, steps: int = 100) -> tuple[float, float] | None:
        """Mean max/mean rank cost over the first ``steps`` steps: plain, balanced (None
        without balancing)."""
        if not self.plan.balanced:
            return None
        from longboat.core.data.batch_plan import mean_imbalance

        return mean_imbalance(self.plan, steps)

    def make_gate(self, guard: Any, schedule: Any) -> UpdateGate:
        return self.engine_gate(guard, schedule, microbatches=self.global_batch // self.dp)

    def step(self, step: int, batch: list[dict[str, Any]], gate: UpdateGate) -> StepOutput:
        for b in batch:  # counted on the host, before the copy: no device read in the step
            b["num_targets"] = float(b["loss_mask"].sum())
        micro = [batch_to_device(b, self.device, keep_on_host=HOST_KEYS) for b in batch]
        return self.step_fn.run_step(step, micro, gate)

    def evaluate(self) -> dict[str, float]:
        rows = self.data.eval
        if rows is None:
            return {}
        n = min(len(rows), max(1, self.cfg.vlm.eval_batches) * self.dp)
        mine = [
            batch_to_device(rows[i], self.device, keep_on_host=HOST_KEYS)
            for i in range(self.dp_rank, n, self.dp)
        ]
        loss = torch.tensor([self.step_fn.evaluate(mine) if mine else 0.0, float(len(mine))])
        if self.dp > 1:
            from megatron.core import parallel_state as mps

            loss[0] *= loss[1]
            dist.all_reduce(loss, group=mps.get_data_parallel_group_gloo())
            loss[0] /= loss[1].clamp(min=1.0)
        return {"eval_loss": float(loss[0])}

    def export(self) -> Path | None:
        if not self.cfg.export.enabled:
            return None
        from longboat.vlm.train.lora import (
            adapter_export_problem,
            merged_language,
            save_language_adapter,
        )

        cfg = self.cfg
        family_module = self.family.load()
        self.adapter_note = None
        problem = adapter_export_problem(family_module, cfg.model.freeze)
        if cfg.lora.enabled and problem is not None:
            self.adapter_note = (
                f"PEFT adapter: not written (the {self.family.name} family {problem[0]}; "
                f"{problem[1]}use the merged HF export)"
            )
        if cfg.lora.enabled and problem is None:
            # the adapters on their own, before the export merges them
            self.adapter_dir = save_language_adapter(
                self.step_fn.model,
                self.model_cfg,
                family_module,
                cfg.lora,
                cfg.export.adapter_dir or f"{cfg.output_dir}/hf_adapter",
                frozen=cfg.model.freeze,
                base_model=cfg.model.init_from,
            )
        out = Path(self.cfg.export.dir or f"{self.cfg.output_dir}/hf")
        with merged_language(self.step_fn.model):  # the adapters folded in, then put back
            self.family.load().save_hf(self.step_fn.model, self.model_cfg, out)
        if self.is_main:
            from longboat.vlm.train.export import write_generation_config

            self.data.save_processing(out)
            write_generation_config(out, self.data.tokenizer, self.cfg.model.init_from)
        return out

    def describe(self) -> list[str]:
        m, lay, rows = self.model_cfg, self.layout, self.data.train
        lang, vis = m.language, m.vision
        vit_tp = ""
        if self.step_fn.model.vision_split is not None:
            vit_tp = ", ViT tp=1 (data-parallel encoding over the TP group)"
        lines = [
            f"Model {self.family.name}/"
            f"{self.cfg.model.flavor if not self.cfg.model.init_from else 'hf'}:"
            f" ViT {vis.depth} layers x {vis.hidden_size}, decoder {lang.num_layers} layers x "
            f"{lang.hidden_size}, vocab {lang.vocab_size}; {self.precision}; "
            f"tp={lay.tensor_parallel} pp={lay.pipeline_parallel} dp={lay.data_parallel}"
            f"{f' ep={lay.expert_parallel}' if lay.expert_parallel > 1 else ''}"
            f"{vit_tp}. Data: {len(rows)} packed rows of "
            f"{rows.seq_len} tokens ({rows.fill:.0%} filled) from {len(rows.samples)} samples; "
            f"global batch {self.global_batch} rows."
        ]
        lines += self.data.notes
        plan = self.memory_plan
        lines.append(plan if isinstance(plan, str) else plan.line())
        if self.fp8_recipe is not None:
            from longboat.kernels.fp8.model import fp8_summary

            language = [self.step_fn.model.language]
            kept = "the decoder's first and last layers, the vision tower, projector, embeddings, head, router and norms"  # fmt: skip
            lines.append(fp8_summary(language, self.fp8_recipe, self.fp8_table, kept=kept))
        lines += self.step_fn.notices()  # levers that cannot apply, and what runs instead
        if self.exact_main_weights:
            lines.append("fp32 main weights from the checkpoint's values (not their rounding).")
        summary = self.balance_summary()
        if summary is not None:
            lines.append(
                f"DP balancing: max/mean rank cost {summary[0]:.2f} -> {summary[1]:.2f} "
                "(mean of the first 100 steps; vlm.dp_balance=false deals rows plainly)."
            )
        if self.step_fn.lora_adapters:
            lo = self.cfg.lora
            trainable = sum(p.numel() for p in self.step_fn.model.parameters() if p.requires_grad)
            lines.append(
                f"LoRA: rank {lo.rank}, alpha {lo.alpha:g} on {self.step_fn.lora_adapters} "
                f"decoder linears ({', '.join(lo.targets)}); {trainable:,} trainable parameters."
            )
        scaled = {c: f for c, f in self.cfg.model.lr_scale.items() if float(f) != 1.0}
        if scaled:
            lr = self.cfg.optim.lr
            lines.append(
                "Peak LR per component (model.lr_scale): "
                + ", ".join(f"{c} {float(f) * lr:.3g}" for c, f in scaled.items())
                + f", the rest {lr:.3g}."
            )
        if self.step_fn.frozen_params:
            lines.append(
                f"Frozen: {', '.join(self.cfg.model.freeze)} ({self.step_fn.frozen_params:,} "
                "parameters)."
            )
        return lines

    def report(self, result: RunResult) -> list[str]:
        lines = []
        if result.export_dir is not None:
            lines.append(f"HF export:   {result.export_dir}")
        if getattr(self, "adapter_dir", None) is not None:
            lines.append(f"PEFT adapter: {self.adapter_dir} (peft.PeftModel.from_pretrained)")
        elif getattr(self, "adapter_note", None) is not None:
            lines.append(self.adapter_note)
        n = self.cfg.vlm.answer_eval_samples
        if self.is_main and result.export_dir is not None and n > 0:
            from longboat.vlm.train.data import answer_held_out

            right, total, example = answer_held_out(result.export_dir, self.data, n)
            result.extra["answers_right"] = right
            result.extra["answers_asked"] = total
            lines.append(
                f"Held-out questions answered by transformers from the export: {right}/{total}"
            )
            if example:
                lines.append(example)
        return lines

    def _checkpoint_module(self) -> torch.nn.Module:
        """The model, or with tensor / pipeline / expert parallelism a view whose names carry
        this rank's coordinates (every rank holds a different shard under the same names)."""
        from longboat.core.megatron.training import rank_prefix, rank_view

        model, lay = self.step_fn.model, self.layout
        if lay.tensor_parallel * lay.pipeline_parallel * lay.expert_parallel == 1:
            return model
        return rank_view(model.named_parameters(), rank_prefix())


def build_training(cfg: Any) -> VLMTraining:
    """The VLM stack's assembly of a run from a composed config (see the module doc)."""
    return VLMTraining(typed_config(cfg))


def train(cfg: Any, *, on_step: Callable[[int], None] | None = None) -> RunResult:
    """Train the experiment described by a composed, validated config (the ``train`` command)."""
    return run_training(cfg, build_training, on_step=on_step)


__all__ = ["VLMTraining", "build_training", "recompute_components", "train"]
