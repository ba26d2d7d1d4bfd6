"""``longboat-diffusion train``: the diffusion stack's run on core's trainer.

``build_training(cfg)`` is the stack's one assembly (the command line and benchmarks call
it): the config checked whole (``checks.check_experiment``), the process group (a one-rank
group when not launched by torchrun), megatron's parallel state (tensor, context and data
parallel), the data (the quickstart writes its synthetic sets first; training batches of
every step from core's global batch plan, the held-out set batched once), the model (its
flavor, or a diffusers directory with ``model.init_from``) and the step on megatron's DDP +
distributed optimizer (``DiffusionTrainStep``). The checkpoint holds the model, the
optimizer's shard and the identity of the data order; the step's batches and noise are
functions of the step, so a resumed run continues the loss curve of an uninterrupted one
exactly.

After a finished run the model is exported as a diffusers directory (a whole pipeline when
there is a source pipeline: ``pipeline_export``) and, for the preview,
held-out captions are sampled in a few Euler steps into an animated GIF under the run
directory (``report``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longboat.core.config.errors import ConfigError
from longboat.core.device.transfer import pins_host_memory
from longboat.core.distributed import run_precision, split_fp8
from longboat.core.megatron.training import MegatronTraining
from longboat.core.train import RunResult, StepOutput, UpdateGate, run_training, typed_config
from longboat.core.train.trainer import Callback
from longboat.diffusion.train.checks import check_experiment, model_family

RESUME_KEYS = (
    "parallel.tensor_parallel",
    "parallel.context_parallel",
    "model.name",
    "model.flavor",
    "model.init_from",
    "model.overrides",
    "data.name",
    "data.batching",
    "ema.enabled",
    "lora.enabled",
    "lora.rank",
    "lora.targets",
)
"""What a checkpoint's sharded model, optimizer shards and data position depend on."""


def _recompute_kind(m: Any) -> str:
    """How recomputed blocks treat attention, for the run summary."""
    if not m.num_recomputed():
        return ""
    return " (attention too)" if m.recompute_attention else " (attention outputs kept)"


def build_dit(family: Any, model_cfg: Any, precision: str, fp8_recipe: str | None = None) -> Any:
    """The run's DiT (``family``: the loaded family module) with fresh weights in
    ``precision``. ``fp8_recipe`` (``train.fp8.recipe`` of a ``train.precision=fp8`` run,
    ``precision`` then bf16): the blocks' attention and MLP linears run their GEMMs in FP8
    (longboat's FP8 linear, as the llm and vlm decoders' do); the first and last blocks, the
    patch, time and caption embeddings, the modulation and the output projection in bf16. On a
    device without FP8 matmuls they are emulated (tests: the command line refuses such a
    device)."""
    from longboat.diffusion.models.common.layers import dit_layer_kernels

    if fp8_recipe is None:
        return family.build(model_cfg, precision=precision)
    from longboat.core.megatron.linears import keep_outer_layers

    model = family.build(model_cfg, precision=precision, kernels=dit_layer_kernels(fp8_recipe))
    keep_outer_layers([model])
    return model


class DiffusionTraining(MegatronTraining):
    """One ``longboat-diffusion train`` run, built (see the module doc)."""

    unit = "samples"
    resume_keys = RESUME_KEYS

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg, num_threads=cfg.diffusion.num_threads)

    def check(self, cfg: Any) -> None:
        self.model_cfg = check_experiment(cfg)

    def _build(self, rank: int) -> None:
        from megatron.core import parallel_state as mps

        from longboat.core.data.batch_plan import batch_layout
        from longboat.core.rng import seed_everything
        from longboat.diffusion.train.data import open_run_data
        from longboat.diffusion.train.step import DiffusionTrainStep
        from longboat.kernels import adamw_master_step_

        cfg = self.cfg
        self.family = model_family(cfg.model)
        precision = run_precision(
            cfg.train.precision, cfg.diffusion.cpu_precision, self.accelerator
        )
        self.precision, self.fp8_recipe = split_fp8(precision, cfg.train.fp8.recipe)
        self.init_layout(cfg.parallel, cfg.train.seed)
        self.dp, self.dp_rank = mps.get_data_parallel_world_size(), mps.get_data_parallel_rank()
        self.device = self.accelerator.device()
        patch = tuple(int(p) for p in self.model_cfg.latent_patch)

        def open_data() -> Any:
            batches = batch_layout(cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                   self.dp)  # fmt: skip
            self.global_batch, self.accumulation = batches.global_batch, batches.accum
            return open_run_data(
                cfg, batches, dp_rank=self.dp_rank, is_main=self.is_main, patch_size=patch,
                pin_memory=pins_host_memory(self.device),
            )  # fmt: skip

        self.data = open_data()
        micro_batch = cfg.train.micro_batch_size
        self.memory_plan = self.plan_memory()
        if cfg.train.micro_batch_size != micro_batch:  # the plan split it: the same samples
            self.data = open_data()  # in more accumulated micro-batches
        self.items_per_step = self._samples_per_step()
        seed_everything(cfg.train.seed, self.accelerator)
        family = self.family.load()
        model = build_dit(family, self.model_cfg, self.precision, self.fp8_recipe)
        exact: dict[str, torch.Tensor] = {}
        lora = cfg.lora if cfg.lora.enabled else None
        if cfg.model.init_from:
            keep = exact if lora is None else None  # frozen base weights have no main copy
            family.load_diffusers(model, self.model_cfg, cfg.model.init_from, keep_fp32=keep)
        self.lora_linears = 0
        """Linears with adapters (0: no LoRA)."""
        if lora is not None:
            from longboat.core.megatron.lora import apply_lora

            self.lora_linears = apply_lora(
                [model], rank=lora.rank, alpha=lora.alpha, targets=list(lora.targets),
                seed=cfg.train.seed,
            )  # fmt: skip
        model.to(self.device)
        dropout = None
        if cfg.data.caption_dropout > 0:
            from longboat.diffusion.data.empty_caption import read_empty_caption_parts
            from longboat.diffusion.train.caption_dropout import CaptionDropout

            parts = read_empty_caption_parts(self.data.train.dataset.roots[0])
            empty = self.data.train.dataset.empty_caption()
            if empty is None or parts is None:
                raise ConfigError(
                    "the training data hold no empty caption embedding",
                    key="data.caption_dropout",
                    fix="run the same `longboat-diffusion data prepare` again over each dataset",
                )
            dropout = CaptionDropout(
                cfg.data.caption_dropout, empty, cfg.train.seed, parts.get("pooled_embeds")
            )
        self.step_fn = DiffusionTrainStep(
            model,
            cfg.optim,
            precision=self.precision,
            objective=cfg.objective,
            seed=cfg.train.seed,
            device=self.device,
            microbatches=self.accumulation,
            cuda_graph=cfg.train.cuda_graph is not False,
            caption_dropout=dropout,
        )
        self.adapter_dir: Path | None = None
        """Where the export wrote the diffusers LoRA (None: none)."""
        self.ema = None
        """The weights' ``EMAWeights`` (``ema.enabled``; None: off)."""
        if cfg.ema.enabled:
            from longboat.core.train.ema import EMAWeights

            self.ema = EMAWeights(dict(model.named_parameters()), cfg.ema)
        self.step_fn.static_shapes_blocker = self._graph_shapes_blocker()
        one_pass = "auto" if cfg.optim.one_pass_adamw else False
        self.step_fn.use_one_pass(one_pass, adamw_master_step_, cfg.optim.moment_dtype)
        self.ddp_modules = [self.step_fn.ddp]
        self._decoder: Any = None
        """The previews' ``LatentDecoder`` (False: none; None: not looked for yet): the
        pipeline's VAE, else the preview set's own."""
        self._decoder_of = ""
        """Whose VAE ``_decoder`` is, for the report."""
        self.exact_main_weights = 0
        """Main weights started from the checkpoint's fp32 values (not its bf16 rounding)."""
        if exact:
            from longboat.core.megatron.optimizer import start_main_weights

            self.exact_main_weights = start_main_weights(self.step_fn.optimizer, model, exact)
            exact.clear()

    def plan_memory(self) -> Any:
        """The run's memory plan (``train.memory.plan_diffusion_memory``), its choice written back into
        ``train.recompute`` / ``train.micro_batch_size`` and the model's recompute fields."""
        from longboat.diffusion.train.checks import recompute_fields
        from longboat.diffusion.train.memory import plan_diffusion_memory

        plan = plan_diffusion_memory(self)
        self.model_cfg = dataclasses.replace(self.model_cfg, **recompute_fields(self.cfg.train))
        return plan

    def _graph_shapes_blocker(self) -> str | None:
        """Why the training batches change shape between steps, if they do (``train.cuda_graph``
        replays one set of shapes)."""
        train = self.data.train
        if train.packed:
            return "packed batches (each step's latent shapes differ)"
        shapes = {tuple(int(v) for v in s) for s in train.dataset.shapes.tolist()}
        if len(shapes) > 1:
            return f"{len(shapes)} latent shapes (a graph replays one: data with one shape)"
        mbs = self.cfg.train.micro_batch_size
        if not self.cfg.data.drop_last and len(train.dataset) % (mbs * self.dp):
            return (
                f"an epoch's last micro-batch holds fewer than {mbs} samples "
                "(set data.drop_last=true)"
            )
        return None

    def _samples_per_step(self) -> int:
        """Samples of a step (packed batches: the mean samples per pack times the packs)."""
        sampler = self.data.train.sampler
        if not self.data.train.packed:
            return self.global_batch
        per_pack = len(sampler.shapes) / max(sampler.num_batches, 1)
        return max(1, round(self.global_batch * per_pack))

    # --- what the trainer needs ----------------------------------------------------------

    def state(self) -> dict[str, Any]:
        from longboat.core.megatron.optimizer import MegatronOptimizerState

        state = {
            "model": self._checkpoint_module(),
            "optimizer": MegatronOptimizerState(self.step_fn.optimizer),
            "data": self.data.train,
        }
        if self.ema is not None:
            state["ema"] = self.ema  # per rank: each holds the average of its shards
        return state

    def optimizers(self) -> list[Any]:
        from longboat.core.megatron.optimizer import inner_optimizers

        return inner_optimizers(self.step_fn.optimizer)

    def batches(self, start_step: int) -> Iterator[list[dict[str, Any]]]:
        return self.data.micro_batches(start_step)

    def make_gate(self, guard: Any, schedule: Any) -> UpdateGate:
        return self.engine_gate(guard, schedule, microbatches=self.accumulation)

    def step(self, step: int, batch: list[dict[str, Any]], gate: UpdateGate) -> StepOutput:
        out = self.step_fn.run_step(step, batch, gate)
        if self.ema is not None:
            self.ema.update(step + 1)
        return out

    def evaluate(self) -> dict[str, float]:
        data = self.data
        if data.held_out is None:
            return {}
        sigmas = [float(s) for s in self.cfg.diffusion.eval_sigmas]
        sums = self.step_fn.held_out(data.eval_batches, data.eval_noise, sigmas)
        if self.dp > 1:
            from megatron.core import parallel_state as mps

            dist.all_reduce(sums, group=mps.get_data_parallel_group_gloo())
        n = max(float(sums[-1]), 1.0)
        per_sigma = {f"eval_loss_sigma_{s:g}": float(v) / n for s, v in zip(sigmas, sums)}
        return {"eval_loss": float(sums[:-1].sum()) / n / len(sigmas), **per_sigma}

    def export(self) -> Path | None:
        if not self.cfg.export.enabled:
            return None
        from contextlib import nullcontext

        out = Path(self.cfg.export.dir or f"{self.cfg.output_dir}/diffusers")
        averaged = self.ema.swapped() if self.ema is not None and self.cfg.ema.export else None
        with averaged or nullcontext():
            if not self.lora_linears:
                return self._export_to(out)
            from longboat.core.megatron.lora import merged_lora
            from longboat.diffusion.train.lora import save_diffusers_lora

            self.adapter_dir = save_diffusers_lora(
                self.step_fn.model, self.family, self.model_cfg, self.cfg
            )
            with merged_lora([self.step_fn.model]):
                return self._export_to(out)

    def _export_to(self, out: Path) -> Path:
        """The export (``export``) of the model's weights as they are."""
        from longboat.diffusion.train.pipeline_export import pipeline_source, write_pipeline

        family = self.family.load()
        source = pipeline_source(self.cfg)
        if source is None:
            return family.save_diffusers(self.step_fn.model, self.model_cfg, out)
        family.save_diffusers(self.step_fn.model, self.model_cfg, out / "transformer")
        if self.is_main:
            write_pipeline(source, out, self.family.diffusers_classes[0])
        if dist.is_initialized():
            dist.barrier()
        return out

    def describe(self) -> list[str]:
        m, lay, cfg = self.model_cfg, self.layout, self.cfg
        params = sum(p.numel() for p in self.step_fn.model.parameters()) * lay.tensor_parallel
        source = (
            "diffusers " + str(cfg.model.init_from) if cfg.model.init_from else cfg.model.flavor
        )
        train = self.data.train
        batching = (
            f"packs of up to {cfg.data.max_tokens} tokens"
            if train.packed
            else f"same-shape micro-batches of {cfg.train.micro_batch_size}"
        )
        shapes = sorted({tuple(int(v) for v in s) for s in train.dataset.shapes.tolist()})
        lines = [
            f"Model {self.family.name}/{source}: {m.num_blocks} blocks x {m.hidden_size} "
            f"({m.num_attention_heads} heads), patch {'x'.join(map(str, m.latent_patch))}, "
            f"{m.latent_channels} latent channels, text dim {m.text_dim}; {params / 1e6:.2f}M "
            f"parameters; {self.precision}; tp={lay.tensor_parallel} cp={lay.context_parallel} "
            f"dp={lay.data_parallel}; recompute {m.num_recomputed()}/{m.num_blocks} blocks"
            f"{_recompute_kind(m)}"
            + (
                "; fp32 main weights from the checkpoint's values."
                if self.exact_main_weights
                else "."
            ),
            f"Data {cfg.data.name}: {len(train.dataset)} samples, latent shapes "
            f"{', '.join('x'.join(map(str, s)) for s in shapes)}; {batching}; global batch "
            f"{self.global_batch} ({self.accumulation} per rank per step).",
            f"Objective: flow matching, shift {cfg.objective.shift:g}, "
            f"{cfg.objective.timestep_sampling} timesteps, {cfg.objective.weighting} weighting"
            + (
                f"; {cfg.data.caption_dropout:g} of the captions dropped to the empty one."
                if cfg.data.caption_dropout > 0
                else "."
            ),
        ]
        plan = self.memory_plan
        lines.append(plan if isinstance(plan, str) else plan.line())
        if self.fp8_recipe is not None:  # adaptive: each shape decided when first seen
            from longboat.kernels.fp8.model import fp8_summary

            model = [self.step_fn.model]
            kept = "the first and last blocks, embeddings, modulation and output projection"
            lines.append(fp8_summary(model, self.fp8_recipe, what="DiT block linears", kept=kept))
        if self.lora_linears:
            lo = cfg.lora
            trained = sum(p.numel() for p in self.step_fn.model.parameters() if p.requires_grad)
            lines.append(
                f"LoRA: rank {lo.rank}, alpha {lo.alpha:g} on {self.lora_linears} linears "
                f"({', '.join(lo.targets)}); {trained * lay.tensor_parallel / 1e6:.3f}M "
                "trainable parameters, the base weights frozen."
            )
        if self.ema is not None:
            lines.append(self.ema.describe())
        lines += self.step_fn.notices()  # levers that cannot apply, and what runs instead
        if self.data.held_out is not None:
            sig = ", ".join(f"{float(s):g}" for s in cfg.diffusion.eval_sigmas)
            lines.append(
                f"Held-out: {self.data.eval_count} samples, velocity MSE at sigma {sig} "
                "(fixed noise per sample)."
            )
        return lines

    def report(self, result: RunResult) -> list[str]:
        lines = []
        if result.export_dir is not None:
            whole = (result.export_dir / "model_index.json").is_file()
            what = " (a pipeline: DiffusionPipeline.from_pretrained loads it)" if whole else ""
            lines.append(f"Diffusers:   {result.export_dir}{what}")
            if self.adapter_dir is not None:
                lines.append(f"LoRA:        {self.adapter_dir} (pipe.load_lora_weights loads it)")
                result.extra["adapter_dir"] = str(self.adapter_dir)
        if result.end_step == 0:
            return lines
        res = self.write_preview(result.end_step)
        if res is None:
            return lines
        result.extra["preview"] = str(res.path) if res.path else None
        result.extra["preview_captions"] = res.captions
        source = "held-out" if self.data.held_out is not None else "training"
        pixels = f"decoded by {self._decoder_of}" if self._decoder else "latents in colour"
        lines.append(
            f"Preview:     {res.path} ({len(res.captions)} {source} captions, "
            f"{self.cfg.diffusion.sample_steps} Euler steps, {pixels}; each sample left of "
            "its dataset clip, the caption under them)"
        )
        if res.colour_right is not None:
            n = len(res.captions)
            result.extra["preview_colour_right"] = res.colour_right
            result.extra["preview_direction_right"] = res.direction_right
            result.extra["preview_moving"] = res.moving
            lines.append(
                f"Read back from the samples: colour matches the caption {res.colour_right}/{n}"
                + (f", motion direction {res.direction_right}/{res.moving}" if res.moving else "")
                + "."
            )
            c, r = res.captions[0], res.readings[0]
            lines.append(f'  e.g. "{c}": read colour {r[0]}' + (f", motion {r[1]}" if r[1] else ""))
        return lines

    def preview_set(self) -> Any:
        """The dataset whose captions the previews sample: the held-out set, else the
        training set (None: previews off)."""
        run = self.cfg.diffusion
        if not run.preview or run.preview_captions < 1:
            return None
        return self.data.held_out if self.data.held_out is not None else self.data.train.dataset

    def write_preview(self, step: int) -> Any:
        """Sample the preview captions with the model as it is and write
        ``<output_dir>/preview/step_<step>.gif`` (``.png`` for images); None when previews
        are off. Every rank takes part (context parallelism samples together)."""
        from longboat.diffusion.data.vae_decode import LatentDecoder
        from longboat.diffusion.train.pipeline_export import pipeline_source
        from longboat.diffusion.train.preview import pick_captions, preview

        dataset = self.preview_set()
        if dataset is None:
            return None
        run = self.cfg.diffusion
        if self._decoder is None and self.is_main:
            source = pipeline_source(self.cfg)  # the VAE decodes on the run's device
            decoder = LatentDecoder.of_pipeline(source, device=self.device)
            self._decoder_of = "the pipeline's VAE"
            if decoder is None:
                decoder = LatentDecoder.of_dataset(dataset, device=self.device)
                self._decoder_of = "the data set's VAE"
            self._decoder = decoder or False
        indices = pick_captions(dataset, run.preview_captions, run.eval_samples)
        shift = run.sample_shift if run.sample_shift is not None else self.cfg.objective.shift
        return preview(
            self.step_fn.model,
            dataset,
            indices,
            Path(self.cfg.output_dir) / "preview" / f"step_{step:08d}",
            steps=run.sample_steps,
            shift=shift,
            seed=self.cfg.train.seed,
            num_train_timesteps=self.cfg.objective.num_train_timesteps,
            device=self.device,
            write=self.is_main,
            decoder=self._decoder or None,
            video=run.preview_format,
        )

    def callbacks(self) -> list[Any]:
        """The memory plan's measured-peak line (where it planned) and the periodic preview."""
        from longboat.core.engine.memory.report import MeasuredPeak

        out: list[Any] = []
        if not isinstance(self.memory_plan, str):
            out.append(MeasuredPeak(self.accelerator, self.memory_plan))
        every = self.cfg.diffusion.preview_every
        if every >= 1 and self.preview_set() is not None:
            out.append(PreviewEvery(self, every))
        return out

    def _checkpoint_module(self) -> torch.nn.Module:
        """The model, or under tensor parallelism a view whose names carry this rank's
        coordinates (every TP rank holds a different shard under the same names)."""
        from longboat.core.megatron.training import rank_prefix, rank_view

        model = self.step_fn.model
        if self.layout.tensor_parallel == 1:
            return model
        return rank_view(model.named_parameters(), rank_prefix())


class PreviewEvery(Callback):
    """Writes a preview every ``diffusion.preview_every`` steps (the last step's is the
    end-of-run preview ``report`` writes)."""

    def __init__(self, training: DiffusionTraining, every: int) -> None:
        self.training, self.every = training, every

    def on_step_end(self, trainer: Any, step: int, out: StepOutput) -> None:
        if step % self.every == 0 and step != self.training.cfg.train.steps:
            res = self.training.write_preview(step)
            if res is not None and res.path is not None:
                trainer.console.print(f"Preview:     {res.path} (step {step})")


def build_training(cfg: Any) -> DiffusionTraining:
    """The diffusion stack's assembly of a run from a composed config (see the module doc)."""
    return DiffusionTraining(typed_config(cfg))


def train(cfg: Any, *, on_step: Callable[[int], None] | None = None) -> RunResult:
    """Train the experiment described by a composed, validated config (the ``train`` command)."""
    return run_training(cfg, build_training, on_step=on_step)


__all__ = ["DiffusionTraining", "build_training", "train"]
