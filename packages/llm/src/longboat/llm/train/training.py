"""``longboat-llm train``: the LLM stack's run on core's trainer.

``build_training(cfg)`` is the stack's one assembly, called by the command line and by the
benchmarks alike: checks of the config (core validated every key before), the process group
(a one-rank group when not launched by torchrun: megatron needs one), the data (the
quickstart prepares its own), megatron's parallel state, then ``build_train_step`` (model,
initial HF weights, LoRA, megatron DDP + distributed optimizer, the update) and the step's
levers from the config (``optim.one_pass_adamw``, ``train.cuda_graph``, ``train.compile``,
``llm.fused_linear_ce``, ``llm.wgrad_fusion``). ``longboat.core.train.Trainer`` runs the loop.

A step reads nothing on the host where it can: the microbatches go to the device through
pinned memory without waiting, the loss is read at log lines, and the step, its update and
its NaN gate are core's megatron step engine's (``core.megatron.engine``: the CUDA-graph
step, else the skip decided on the device with its host side one step late, else the
synchronous gate where megatron's step reads on the host anyway).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from longboat.core.device.transfer import batch_to_device
from longboat.core.distributed import run_precision, split_fp8
from longboat.core.megatron.quiet import quiet_megatron
from longboat.core.megatron.training import MegatronTraining
from longboat.core.train import (
    RunResult,
    StepOutput,
    UpdateGate,
    run_training,
    typed_config,
)

RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
}
"""megatron's recompute settings per ``train.recompute``: selective recomputes each layer's
core attention (softmax and its dropout), full every layer whole."""


def recompute_settings(mode: str, layers: int | None) -> dict[str, Any]:
    """megatron's ``TransformerConfig`` recompute fields for ``train.recompute`` /
    ``train.recompute_layers`` (full only: whole the first ``layers`` layers of each pipeline
    stage, megatron's ``block`` method)."""
    if mode == "full" and layers is not None:
        return {
            "recompute_granularity": "full",
            "recompute_method": "block",
            "recompute_num_layers": layers,
        }
    return dict(RECOMPUTE[mode])


RESUME_KEYS = (
    "parallel.tensor_parallel",
    "parallel.pipeline_parallel",
    "parallel.virtual_pipeline_parallel",
    "parallel.expert_parallel",
    "lora.enabled",
    "lora.rank",
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.ffn_hidden_size",
    "model.vocab_size",
    "model.num_experts",
    "model.moe_experts",
)
"""What a checkpoint's sharded model and optimizer state depend on."""


def family_resume_keys(model: Any) -> tuple[str, ...]:
    """The architecture fields a family adds to core's decoder config (a ``DecoderModelConfig``
    subclass's ``architecture()``, e.g. DeepSeek-V3's latent ranks): a checkpoint's sharded
    state follows them as it follows ``RESUME_KEYS``."""
    from longboat.core.megatron.decoder_config import ARCH_FIELDS

    own = getattr(model, "architecture", dict)()
    return tuple(f"model.{name}" for name in own if name not in ARCH_FIELDS)


class LLMTraining(MegatronTraining):
    """One ``longboat-llm train`` run, built (see the module doc)."""

    unit = "tokens"
    resume_keys = RESUME_KEYS

    def __init__(self, cfg: Any) -> None:
        self.model_cfg = cfg.model
        self.resume_keys = RESUME_KEYS + family_resume_keys(cfg.model)
        super().__init__(cfg, num_threads=cfg.llm.num_threads)

    def check(self, cfg: Any) -> None:
        from longboat.llm.train.checks import check_run

        # The layout against the launch's world size too, before any data is tokenised.
        check_run(cfg, self.model_cfg, world_size=int(os.environ.get("WORLD_SIZE", "1") or 1))

    def _build(self, rank: int) -> None:
        from megatron.core import parallel_state as mps

        from longboat.core.data.batch_plan import batch_layout
        from longboat.core.data.packing import PackedDataset
        from longboat.core.rng import seed_everything
        from longboat.llm.train.data import open_run_data, row_plan, train_and_eval_documents

        cfg, data = self.cfg, self.cfg.data
        parts, self.tokenizer_dir = open_run_data(data, self.model_cfg.vocab_size, rank)
        self.chat_data = any(len(p) and isinstance(p[0], dict) for p in parts)
        """Whether the run trains on chats (SFT documents carry a loss mask)."""
        train_docs, eval_docs = train_and_eval_documents(data, parts)
        self.train_rows = PackedDataset(train_docs, data.seq_len)
        self.eval_rows = PackedDataset(eval_docs, data.seq_len) if len(eval_docs) else None
        self.resolve_precision()
        self.init_layout(cfg.parallel, cfg.train.seed)
        self.memory_plan = self.plan_memory(rows_per_sample=1, fused_ce=cfg.llm.fused_linear_ce)
        batches = batch_layout(
            cfg.train.global_batch_size, cfg.train.micro_batch_size, self.layout.data_parallel
        )
        self.plan = row_plan(len(self.train_rows), batches, data.seed)
        self.items_per_step = batches.global_batch * data.seq_len
        self.dp_rank = mps.get_data_parallel_rank()
        self.device = self.accelerator.device()
        seed_everything(cfg.train.seed, self.accelerator)
        self.step_fn = self._build_step()
        self.fp8_table = self._decide_adaptive(data.seq_len * cfg.train.micro_batch_size)
        self.ddp_modules = list(self.step_fn.model)

    def resolve_precision(self) -> None:
        """``precision`` of the weights and ``fp8_recipe`` (``train.fp8.recipe`` of an FP8 run,
        whose weights then train in bf16; else None) from ``train.precision`` and the device."""
        cfg = self.cfg
        precision = run_precision(cfg.train.precision, cfg.llm.cpu_precision, self.accelerator)
        self.precision, self.fp8_recipe = split_fp8(precision, cfg.train.fp8.recipe)
        self.fp8_table = ""

    def plan_memory(self, *, rows_per_sample: int, fused_ce: bool) -> Any:
        """The run's memory plan (``train.memory_budget``; core's
        ``megatron.engine.memory_shapes.plan_megatron_run``), its choices written back:
        ``train.recompute`` and, split, ``train.micro_batch_size`` (the global batch kept). A
        str (the plan's line) where the model's shapes have no estimate (a family with its
        own architecture fields other than multi-head latent attention's, or DeepSeek-V3.2's
        indexer trained by its KL loss). ``rows_per_sample``: packed rows in one sample
        (DPO: a pair is two)."""
        from longboat.core.megatron.engine.latent_shapes import (
            LatentDecoderShapes,
            is_latent_attention,
        )
        from longboat.core.megatron.engine.memory_plan import DecoderShapes, OptimizerPlan
        from longboat.core.megatron.engine.memory_shapes import plan_megatron_run, unplanned
        from longboat.core.megatron.engine.moments import moment_plan_fields

        cfg, t, m = self.cfg, self.cfg.train, self.model_cfg
        latent = is_latent_attention(m)
        if latent and getattr(m, "index_loss_coeff", 0):
            return unplanned(t, "the estimate does not cover the sparse attention's indexer "
                             "KL loss (model.index_loss_coeff > 0)")  # fmt: skip
        if not latent and family_resume_keys(m):
            return unplanned(t, f"the estimate does not cover {m.name}'s own architecture "
                             "fields")  # fmt: skip
        dp = self.layout.data_parallel
        shapes = (LatentDecoderShapes if latent else DecoderShapes).of(
            m,
            seq_len=cfg.data.seq_len * rows_per_sample,
            precision=self.precision,
            layout=self.layout,
            fused_ce=fused_ce,
        )
        opt = OptimizerPlan(
            data_parallel=dp,
            precision=self.precision,
            optimizer=cfg.optim.name,
            trainable_fraction=0.0 if cfg.lora.enabled else 1.0,
            bf16_grads_single_pass=cfg.llm.wgrad_fusion and not t.compile,
            **moment_plan_fields(cfg),
        )
        modes = ("none", "selective", "full")
        if m.num_experts and m.moe_aux_loss == "hf" and m.moe_aux_loss_coeff:
            modes = ("none", "selective")  # transformers' pooled term needs the router's graph
        return plan_megatron_run(t, shapes, opt, self.accelerator, data_parallel=dp,
                                 micro_batch_pinned=t.cuda_graph is True,
                                 recompute_modes=modes, optim=cfg.optim)  # fmt: skip

    def callbacks(self) -> list[Any]:
        """The memory plan's measured-peak line after the first steps (where it planned)."""
        from longboat.core.engine.memory.report import MeasuredPeak

        if isinstance(self.memory_plan, str):
            return []
        return [MeasuredPeak(self.accelerator, self.memory_plan)]

    def _build_step(self) -> Any:
        from longboat.llm.hf_checkpoint import load_hf
        from longboat.llm.train.lm_step import build_train_step, wants_exact_main_weights

        cfg, init = self.cfg, self.cfg.model.init_from
        lora = cfg.lora if cfg.lora.enabled else None
        return build_train_step(
            self.model_cfg,
            cfg.optim,
            precision=self.precision,
            device=self.device,
            microbatches=self.plan.layout.accum,
            fused_linear_ce=cfg.llm.fused_linear_ce,
            wgrad_fusion=cfg.llm.wgrad_fusion,
            compile_layers=cfg.train.compile,
            init_weights=(lambda c: load_hf(c, self.model_cfg, init)) if init else None,
            exact_main_weights=bool(init)
            and wants_exact_main_weights(init, self.precision, lora is not None),
            lora=lora,
            seed=cfg.train.seed,
            cuda_graph=cfg.train.cuda_graph is not False,
            one_pass_adamw="auto" if cfg.optim.one_pass_adamw else False,
            fp8_recipe=self.fp8_recipe,
            **recompute_settings(cfg.train.recompute, cfg.train.recompute_layers),
        )

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

    def batches(self, start_step: int) -> Iterator[list[dict[str, Any]]]:
        """This rank's microbatches of every step, built on the host (CPU tensors)."""
        from longboat.llm.train.data import microbatch

        cpu, doc_attn = torch.device("cpu"), self.cfg.data.document_attention
        for step in itertools.count(start_step):
            yield [
                microbatch([self.train_rows[i] for i in rows], cpu, document_attention=doc_attn)
                for rows in self.plan.rank_micro_batches(step, self.dp_rank)
            ]

    def make_gate(self, guard: Any, schedule: Any) -> UpdateGate:
        return self.engine_gate(guard, schedule, microbatches=self.plan.layout.accum)

    @property
    def graphed(self) -> Any:
        """The engine's CUDA-graph step when the run took it (``train.cuda_graph``), else None."""
        return self.step_fn.graph_step

    def step(self, step: int, batch: list[dict[str, Any]], gate: UpdateGate) -> StepOutput:
        micro = [batch_to_device(b, self.device) for b in batch]
        return self.step_fn.run_step(step, micro, gate)

    def evaluate(self) -> dict[str, float]:
        from longboat.llm.train.data import microbatch, row_plan
        from longboat.llm.train.megatron_schedule import evaluate

        if self.eval_rows is None:
            return {}
        cfg = self.cfg
        es = row_plan(len(self.eval_rows), self.plan.layout, seed=0, shuffle=False)
        doc_attn = cfg.data.document_attention
        micro = [
            microbatch([self.eval_rows[i] for i in rows], self.device, document_attention=doc_attn)
            for step in range(max(1, cfg.llm.eval_batches))
            for rows in es.rank_micro_batches(step, self.dp_rank)
        ]
        loss = evaluate(self.step_fn.model, micro, self.device, fused_ce=cfg.llm.fused_linear_ce)
        return {"eval_loss": loss}

    def export(self) -> Path | None:
        if not self.cfg.export.enabled:
            return None
        from longboat.llm.train.export import export_hf

        cfg = self.cfg
        if cfg.lora.enabled:  # the adapters on their own, before export_hf merges them
            from longboat.llm.peft import peft_export_problem, save_peft

            self.adapter_note = peft_export_problem(self.model_cfg, cfg.lora.targets)
        if cfg.lora.enabled and self.adapter_note is None:
            self.adapter_dir = save_peft(
                self.step_fn.chunks,
                self.model_cfg,
                cfg.export.adapter_dir or f"{cfg.output_dir}/hf_adapter",
                rank=cfg.lora.rank,
                alpha=cfg.lora.alpha,
                base_model=cfg.model.init_from,
            )
        out = cfg.export.dir or f"{cfg.output_dir}/hf"
        return export_hf(
            self.step_fn.chunks,
            self.model_cfg,
            out,
            tokenizer_dir=self.tokenizer_dir,
            source_dir=self.cfg.model.init_from,
        )

    def _decide_adaptive(self, tokens: int) -> str | None:
        """``train.fp8.recipe=adaptive``: FP8 or bf16 per linear shape, measured on this GPU
        before the first step (or read from the timing cache); the decisions as a table."""
        if self.fp8_recipe != "adaptive":
            return None
        from longboat.kernels.fp8.model import decide_adaptive

        return decide_adaptive(self.step_fn.chunks, tokens, self.device) or None

    def fp8_line(self) -> str:
        """How many of the decoder layers' linears and grouped MoE experts run in FP8."""
        from longboat.kernels.fp8.model import fp8_summary

        return fp8_summary(self.step_fn.chunks, str(self.fp8_recipe), self.fp8_table or "")

    def describe(self) -> list[str]:
        m, s, lay, rows = self.model_cfg, self.plan.layout, self.layout, self.train_rows
        lines = [
            f"Model {m.name}/{m.flavor}: {m.num_layers} layers, hidden {m.hidden_size}, vocab "
            f"{m.vocab_size}; {self.precision}; tp={lay.tensor_parallel} "
            f"pp={lay.pipeline_parallel} dp={lay.data_parallel}. Data: {len(rows)} packed rows "
            f"of {rows.seq_len} tokens ({rows.fill:.0%} filled); global batch {s.global_batch} = "
            f"{s.accum} microbatch(es) x {s.micro_batch} x dp {s.dp_size}."
        ]
        lines.append(self.schedule_line())
        plan = self.memory_plan
        lines.append(plan if isinstance(plan, str) else plan.line())
        if self.fp8_recipe is not None:
            lines.append(self.fp8_line())
        if self.cfg.lora.enabled:
            lines.append(self.lora_line())
        lines += self.step_fn.notices()  # levers that cannot apply, and what runs instead
        if self.step_fn.aux_loss_notice:
            lines.append(self.step_fn.aux_loss_notice)
        if self.step_fn.experts_notice:
            lines.append(self.step_fn.experts_notice)
        if self.step_fn.lora_notice:
            lines.append(self.step_fn.lora_notice)
        return lines

    def lora_line(self) -> str:
        """What LoRA trains: its settings and this rank's trainable share of the model."""
        lo = self.cfg.lora
        params = [p for chunk in self.step_fn.chunks for p in chunk.parameters()]
        trainable = sum(p.numel() for p in params if p.requires_grad)
        total = sum(p.numel() for p in params)
        return (
            f"LoRA: rank {lo.rank}, alpha {lo.alpha:g} on {', '.join(lo.targets)}; "
            f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%)."
        )

    def schedule_line(self) -> str:
        """How much of the data the run sees and how its LR gets there: a short run on small
        data says why its loss moves little."""
        cfg, s = self.cfg, self.plan.layout
        steps, warmup = cfg.train.steps, cfg.optim.schedule.warmup_steps
        passes = steps * s.global_batch / max(1, len(self.train_rows))
        line = (
            f"Run: {steps} steps x {s.global_batch} rows = {passes:.2f} passes over the "
            f"{len(self.train_rows)} training rows; LR peaks at {cfg.optim.lr:g} after "
            f"{warmup} warm-up steps."
        )
        if warmup * 2 >= steps > 0:
            line += (
                " Half the run or more is LR warm-up: raise train.steps or lower "
                "optim.schedule.warmup_steps."
            )
        return line

    def report(self, result: RunResult) -> list[str]:
        lines = []
        if result.export_dir is not None:
            lines.append(f"HF export:   {result.export_dir}")
        if getattr(self, "adapter_dir", None) is not None:
            lines.append(f"PEFT adapter: {self.adapter_dir} (peft.PeftModel.from_pretrained)")
        if getattr(self, "adapter_note", None) is not None:
            lines.append(f"PEFT adapter: not written ({self.adapter_note}).")
        prompt = self.cfg.llm.generate_prompt
        if not (self.is_main and result.export_dir is not None and prompt):
            return lines
        if self.tokenizer_dir is None:
            return [*lines, "No generation: this data kind has no tokenizer."]
        from longboat.llm.train.export import describe_generation, greedy_generate

        penalty, chat = self.cfg.llm.generate_repetition_penalty, self.generates_chat()
        text = greedy_generate(
            result.export_dir,
            prompt,
            self.cfg.llm.generate_tokens,
            repetition_penalty=penalty,
            chat=chat,
        )
        result.extra["generation"] = text
        result.extra["generation_chat"] = chat
        how = f", repetition penalty {penalty}" if penalty != 1.0 else ""
        how += ", the prompt as a user turn through the chat template" if chat else ""
        return [
            *lines,
            f"Greedy generation from the export (transformers{how}):",
            describe_generation(text, prompt, chat=chat),
        ]

    def generates_chat(self) -> bool:
        """Whether ``llm.generate_prompt`` goes in through the chat template:
        ``llm.generate_chat``, or (null) when the run trains on chats and the tokenizer has a
        template."""
        wanted = self.cfg.llm.generate_chat
        if wanted is not None:
            return bool(wanted)
        if not self.chat_data or self.tokenizer_dir is None:
            return False
        from longboat.llm.data.encoding import load_tokenizer

        return bool(getattr(load_tokenizer(self.tokenizer_dir), "chat_template", None))

    # --- helpers -------------------------------------------------------------------------

    def _checkpoint_module(self) -> torch.nn.Module:
        """What the checkpoint saves as ``model``.

        Without model parallelism (and without LoRA) the chunk itself, so the checkpoint is a
        native checkpoint ``longboat-llm convert native-to-hf`` reads. Otherwise a view whose
        names carry this rank's (tp, pp, ep) coordinates, since every rank holds a different
        shard under the same megatron names; with LoRA only the adapters (the base comes from
        ``model.init_from`` or the seed).
        """
        from longboat.core.megatron.training import rank_prefix, rank_view

        chunks, lora, lay = self.step_fn.chunks, self.cfg.lora.enabled, self.layout
        mp = lay.tensor_parallel * lay.pipeline_parallel * lay.expert_parallel
        if not lora and len(chunks) == 1 and mp == 1:
            return chunks[0]
        named = [
            (f"c{i}.{name}", p)
            for i, chunk in enumerate(chunks)
            for name, p in chunk.named_parameters()
            if not (lora and not p.requires_grad)
        ]
        return rank_view(named, rank_prefix())


def build_training(cfg: Any) -> LLMTraining:
    """The LLM stack's assembly of a run from a composed config (a DictConfig, converted
    once, or the typed ``LLMExperimentConfig``; see the module doc): ``DPOTraining`` for
    ``llm.objective=dpo``."""
    typed = typed_config(cfg)
    if typed.llm.objective == "dpo":
        from longboat.llm.train.dpo_training import DPOTraining

        return DPOTraining(typed)
    return LLMTraining(typed)


def train(cfg: Any, *, on_step: Callable[[int], None] | None = None) -> RunResult:
    """Train the experiment described by a composed, validated config (the ``train`` command).

    ``on_step(step)`` is called after every completed step with the run's state exact (tests
    use it to deliver a signal at a known step).
    """
    return run_training(cfg, build_training, on_step=on_step)


__all__ = [
    "RECOMPUTE",
    "LLMTraining",
    "build_training",
    "quiet_megatron",
    "recompute_settings",
    "train",
]
