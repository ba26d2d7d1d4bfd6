"""``longboat-llm train llm.objective=dpo``: the LLM run trained on preference pairs.

``DPOTraining`` is ``LLMTraining`` with other data and another loss: the pairs of
``data.paths`` (``dpo_data``), dealt by core's ``GlobalBatchPlan`` (``train.global_batch_size``
and ``train.micro_batch_size`` count pairs; each is two rows), and the step's loss the DPO
objective (``dpo``) on the same model, optimizer, update and gate (core's megatron step
engine). The reference log-probabilities are computed once after the resume, before the
first step, and saved with every checkpoint (``dpo.ReferenceLogps``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from longboat.core.device.transfer import batch_to_device
from longboat.core.train import StepOutput, UpdateGate
from longboat.llm.train.training import LLMTraining


class DPOTraining(LLMTraining):
    """One ``llm.objective=dpo`` run (see the module doc)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.resume_keys = (*self.resume_keys, "llm.objective")

    def check(self, cfg: Any) -> None:
        from longboat.llm.train.dpo_data import check_preference_inputs

        super().check(cfg)
        check_preference_inputs(cfg.data)  # the first record of each file, before any build

    def _build(self, rank: int) -> None:
        from pathlib import Path

        from megatron.core import parallel_state as mps

        from longboat.core.data.batch_plan import batch_layout
        from longboat.core.rng import seed_everything
        from longboat.llm.train.data import row_plan
        from longboat.llm.train.dpo import ReferenceLogps
        from longboat.llm.train.dpo_data import read_preference_data, split_pairs

        cfg, data = self.cfg, self.cfg.data
        self.tokenizer_dir = Path(data.tokenizer)
        self.pairs = read_preference_data(data, self.tokenizer_dir, self.model_cfg.vocab_size)
        self.chat_data = True  # pairs are chats: the post-run sample uses the chat template
        self.train_index, self.eval_index = split_pairs(
            len(self.pairs), data.eval_fraction, data.seed
        )
        self.reference = ReferenceLogps(len(self.pairs))
        self.resolve_precision()
        self.init_layout(cfg.parallel, cfg.train.seed)
        # a pair is two rows, on megatron's logits path (the objective needs per-token losses)
        self.memory_plan = self.plan_memory(rows_per_sample=2, fused_ce=False)
        batches = batch_layout(
            cfg.train.global_batch_size, cfg.train.micro_batch_size, self.layout.data_parallel
        )
        self.plan = row_plan(len(self.train_index), batches, data.seed)
        self.items_per_step = batches.global_batch * 2 * data.seq_len
        self.dp_rank = mps.get_data_parallel_rank()
        self.device = self.accelerator.device()
        seed_everything(cfg.train.seed, self.accelerator)
        self.step_fn = self._build_step()
        # a microbatch of P pairs is 2P rows
        self.fp8_table = self._decide_adaptive(2 * data.seq_len * cfg.train.micro_batch_size)
        self.ddp_modules = list(self.step_fn.model)

    def _build_step(self) -> Any:
        from longboat.llm.train.dpo import dpo_objective

        step = super()._build_step()
        # The objective's forward step takes megatron's per-token losses (the logits path):
        # fused linear cross-entropy gives only their mean.
        step.objective = dpo_objective(float(self.cfg.llm.dpo.beta))
        step.fused_linear_ce = False
        return step

    # --- what the trainer needs ----------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {**super().state(), "dpo_reference": self.reference}

    def after_resume(self, step: int) -> None:
        """The reference log-probabilities: read from the checkpoint, or computed now with
        the initial weights (a fresh run)."""
        from longboat.core.checkpoint import CheckpointError

        if self.reference.table is not None:
            self.reference.table = self.reference.table.to(self.device)
            return
        if step > 0:
            raise CheckpointError(
                f"the step-{step} checkpoint holds no DPO reference log-probabilities (it was "
                "not written by a DPO run), and the initial weights are gone; start DPO from "
                "exported weights with model.init_from instead"
            )
        self.reference.table = self.compute_reference()

    def compute_reference(self) -> torch.Tensor:
        """``[N, 2]`` log-probabilities of every pair under the model's current weights."""
        from megatron.core import parallel_state as mps

        from longboat.llm.train.dpo import compute_reference_logps

        return compute_reference_logps(
            self.step_fn.model,
            self.pairs,
            self.plan.layout.micro_batch,
            self.device,
            dp_rank=self.dp_rank,
            dp_size=self.layout.data_parallel,
            dp_group=mps.get_data_parallel_group() if self.layout.data_parallel > 1 else None,
        )

    def batches(self, start_step: int) -> Iterator[list[dict[str, Any]]]:
        """This rank's microbatches of pairs of every step (host tensors)."""
        for step in itertools.count(start_step):
            yield [
                self.pairs.microbatch(self.train_index[np.asarray(rows, dtype=np.int64)])
                for rows in self.plan.rank_micro_batches(step, self.dp_rank)
            ]

    def _on_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        micro = batch_to_device(batch, self.device)
        micro["ref_logps"] = self.reference.lookup(micro.pop("pair_index"))
        return micro

    def step(self, step: int, batch: list[dict[str, Any]], gate: UpdateGate) -> StepOutput:
        return self.step_fn.run_step(step, [self._on_device(b) for b in batch], gate)

    def evaluate(self) -> dict[str, float]:
        """DPO loss and reward accuracy of the held-out pairs (forward only)."""
        from longboat.llm.train.data import row_plan
        from longboat.llm.train.dpo import dpo_forward_step
        from longboat.llm.train.megatron_schedule import forward_only, world_mean_of_last_stage

        if not len(self.eval_index) or self.reference.table is None:
            return {}
        from functools import partial

        plan = row_plan(len(self.eval_index), self.plan.layout, seed=0, shuffle=False)
        micro = [
            self._on_device(self.pairs.microbatch(self.eval_index[np.asarray(rows)]))
            for step in range(max(1, self.cfg.llm.eval_batches))
            for rows in plan.rank_micro_batches(step, self.dp_rank)
        ]
        beta = float(self.cfg.llm.dpo.beta)
        out = forward_only(self.step_fn.model, micro, partial(dpo_forward_step, beta=beta))
        return {
            "eval_loss": float(world_mean_of_last_stage(out, self.device, "dpo loss")),
            "eval_reward_accuracy": float(
                world_mean_of_last_stage(out, self.device, "reward accuracy")
            ),
        }

    def describe(self) -> list[str]:
        m, s, lay, pairs = self.model_cfg, self.plan.layout, self.layout, self.pairs
        dpo = self.cfg.llm.dpo
        data = (
            f"Data: {len(self.train_index)} training and {len(self.eval_index)} held-out "
            f"preference pairs of up to {pairs.seq_len} tokens"
        )
        if pairs.truncated:
            data += f" ({pairs.truncated} cut at data.seq_len)"
        if pairs.dropped:
            data += f"; {pairs.dropped} left out (no answer token within data.seq_len)"
        lines = [
            f"Model {m.name}/{m.flavor}: {m.num_layers} layers, hidden {m.hidden_size}, vocab "
            f"{m.vocab_size}; {self.precision}; tp={lay.tensor_parallel} "
            f"pp={lay.pipeline_parallel} dp={lay.data_parallel}. {data}; global batch "
            f"{s.global_batch} pairs = {s.accum} microbatch(es) x {s.micro_batch} x dp "
            f"{s.dp_size}.",
            f"Objective: DPO, beta {float(dpo.beta):g}, reference = the initial weights "
            "(log-probabilities computed once before the first step, kept in checkpoints); "
            "loss through the logits (per-token log-probabilities).",
            self.schedule_line().replace(" rows", " pairs"),
        ]
        if self.cfg.lora.enabled:
            lines.append(self.lora_line())
        lines += self.step_fn.notices()
        lines += [n for n in (self.step_fn.aux_loss_notice, self.step_fn.experts_notice) if n]
        return lines

    @property
    def train_rows(self) -> Any:
        """The training pairs (``schedule_line`` counts them)."""
        return self.train_index


__all__ = ["DPOTraining"]
