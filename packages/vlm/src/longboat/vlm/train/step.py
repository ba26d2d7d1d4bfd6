"""One VLM optimizer step on megatron's DDP + distributed optimizer.

``VLMTrainStep`` wraps a ``VisionLanguageModel`` (vision tower + megatron decoder) in
megatron's ``DistributedDataParallel`` and builds the distributed optimizer (fp32 main
weights and moments sharded over data-parallel ranks); frozen components
(``model.vision.freeze``, ``model.projector.freeze``, ``model.language.freeze``) get no
gradient and no optimizer state; with ``lora`` the decoder's base weights are frozen and
only its adapters train (``longboat.vlm.train.lora``). The loss is the mean over every
loss-masked token of the global batch (all microbatches, all data-parallel ranks), so a
packed row of many short samples weighs its tokens like a row of one long sample. With
pipeline parallelism the microbatches run through megatron's 1F1B schedule with the same
loss (``longboat.vlm.train.pipeline``). An unsharded tower under a tensor-parallel decoder
(``model.vision_tensor_parallel=1``) has its gradients summed over the TP ranks, which
encoded different images, before DDP's reduction.

``VLMTrainStep`` is a core ``MegatronStepEngine``: it gives the engine its optimizer and
``forward_backward``; the engine owns the update, the NaN gate (lagged where the update can
skip on the device) and the CUDA-graph step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.engine import MegatronStepEngine
from longboat.vlm.train.pipeline import (
    from_last_stage,
    pipeline_parallel_size,
    pipelined_evaluate,
    pipelined_forward_backward,
)

COMPONENTS = ("vision", "projector", "language")
"""What ``freeze`` names: the ViT blocks, its projector (Qwen2.5-VL: the patch merger), the
decoder."""


def component_params(model: Any, component: str) -> list[torch.nn.Parameter]:
    """The parameters of one component of a ``VisionLanguageModel``."""
    if component == "language":
        return list(model.language.parameters())
    if model.vision is None and component in ("vision", "projector"):
        return []  # a pipeline stage after the first: the tower is not here
    merger = getattr(model.vision, "merger", None)
    merger_ids = {id(p) for p in merger.parameters()} if merger is not None else set()
    if component == "projector":
        return [p for p in model.vision.parameters() if id(p) in merger_ids]
    if component == "vision":
        return [p for p in model.vision.parameters() if id(p) not in merger_ids]
    raise ConfigError(f"unknown component {component!r}", fix=f"use one of {list(COMPONENTS)}")


def freeze(model: Any, components: Sequence[str]) -> int:
    """Turn off gradients of ``components``; returns the number of frozen parameters."""
    n = 0
    for component in components:
        for p in component_params(model, component):
            p.requires_grad_(False)
            n += p.numel()
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            "every component is frozen: nothing would train",
            fix="unfreeze at least one of model.vision / model.projector / model.language",
        )
    return n


def check_lr_scale(lr_scale: Mapping[str, float], frozen: Sequence[str] = ()) -> None:
    """Refuse a ``model.lr_scale`` that names an unknown or frozen component or a factor that
    is not a positive number."""
    for component, factor in lr_scale.items():
        key = f"model.lr_scale.{component}"
        if component not in COMPONENTS:
            raise ConfigError("is not a component", key=key, fix=f"use one of {list(COMPONENTS)}")
        if component in frozen:
            raise ConfigError(
                "scales the learning rate of a component model.freeze freezes",
                key=key,
                fix=f"drop {component} from model.lr_scale or from model.freeze",
            )
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            raise ConfigError(
                "must be a positive number", key=key, value=factor,
                fix="e.g. 0.1 (a tenth of optim.lr)",
            )  # fmt: skip


MODEL_INPUTS = (
    "input_ids",
    "position_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "cu_seqlens",
)


class VLMTrainStep(MegatronStepEngine):
    """Forward / backward over a step's microbatches; the engine's update and gate."""

    def __init__(
        self,
        model: Any,
        optim: Any,
        *,
        precision: str,
        frozen: Sequence[str] = (),
        lr_scale: Mapping[str, float] | None = None,
        lora: Any = None,
        seed: int = 0,
        cuda_graph: bool = False,
    ) -> None:
        from longboat.core.megatron.optimizer import build_optimizer, wrap_ddp
        from longboat.vlm.train.lora import apply_language_lora

        self.model = model
        # Before DDP: only parameters that require grad get grad buffers and optimizer state.
        self.lora_adapters = apply_language_lora(model, lora, frozen=frozen, seed=seed)
        self.frozen_params = freeze(model, frozen) if frozen else 0
        (self.ddp,) = wrap_ddp([model], distributed_optimizer=True, side_stream=cuda_graph)
        self.graph_ready = cuda_graph
        # Components at their own peak LR (model.lr_scale); with LoRA only its adapters train.
        scaled = {
            c: ([p for p in component_params(model, c) if p.requires_grad], float(f))
            for c, f in (lr_scale or {}).items()
            if float(f) != 1.0
        }
        self.optimizer = build_optimizer(
            [self.ddp], optim, precision=precision, distributed_optimizer=True,
            lr_scale={c: v for c, v in scaled.items() if v[0]} or None,
        )  # fmt: skip
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
            precision
        ]

    def _inputs(self, mb: dict[str, Any]) -> dict[str, Any]:
        out = {k: mb[k] for k in MODEL_INPUTS if mb.get(k) is not None}
        for key in ("pixel_values", "pixel_values_videos"):
            if key in out:
                out[key] = out[key].to(self.dtype)
        return out

    def loss(self, mb: dict[str, Any], denominator: torch.Tensor) -> torch.Tensor:
        """Sum of this microbatch's masked token losses over ``denominator``."""
        per_token = self.ddp(**self._inputs(mb), labels=mb["labels"].clamp(min=0))
        mask = mb["loss_mask"].to(per_token.dtype)
        return (per_token.float() * mask.float()).sum() / denominator

    @staticmethod
    def denominator(microbatches: list[dict[str, Any]]) -> torch.Tensor:
        """The step's loss denominator on the host: its target tokens over every DP rank,
        over the DP size (megatron's DDP averages gradients over DP ranks)."""
        from megatron.core import parallel_state as mps

        # ``num_targets``: counted on the host before the copy (no device read here).
        tokens = torch.tensor(
            sum(float(mb.get("num_targets", mb["loss_mask"].sum())) for mb in microbatches),
            dtype=torch.float64,
        )
        dp = mps.get_data_parallel_world_size()
        if dp > 1:
            dist.all_reduce(tokens, group=mps.get_data_parallel_group_gloo())
        return (tokens.clamp(min=1.0) / dp).float()

    def forward_backward(self, microbatches: list[dict[str, Any]]) -> torch.Tensor:
        """Backward of the global-token-mean loss; returns it (a 0-d tensor, all ranks equal)."""
        from megatron.core import parallel_state as mps

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        dp = mps.get_data_parallel_world_size()
        denominator = self.denominator(microbatches)
        pipelined = pipeline_parallel_size() > 1
        total = torch.zeros((), dtype=torch.float32)
        if not pipelined:  # megatron's schedule sets it for the pipelined path
            self._scale_moe_aux_loss(len(microbatches))
        if pipelined:  # megatron's 1F1B schedule; grads finalised there
            total = pipelined_forward_backward(self, microbatches, denominator)
        else:
            for mb in microbatches:
                loss = self.loss(mb, denominator.to(mb["input_ids"].device))
                loss.backward()
                total = total.to(loss.device) + loss.detach()
            split = self.model.vision_split
            if split is not None:  # each tower replica saw its TP rank's images only
                from longboat.vlm.models.vision_parallel import reduce_tower_grads

                reduce_tower_grads(self.model.vision, split)
            self.ddp.finish_grad_sync()
        if dp > 1:  # on the device's own group: the loss stays on the device
            total = total.detach().to(next(self.model.parameters()).device, copy=True)
            dist.all_reduce(total, group=mps.get_data_parallel_group())
            total = total / dp
        return from_last_stage(total) if pipelined else total

    def _scale_moe_aux_loss(self, microbatches: int) -> None:
        """An MoE decoder's per-layer load-balancing losses (megatron's, added in the
        backward) weigh 1 / ``microbatches`` each, so the step's term is their mean over the
        global batch's microbatches (DDP averages over the data-parallel ranks), whatever
        the split between accumulation and data parallelism."""
        if not getattr(self.model.language.config, "num_moe_experts", None):
            return
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        device = next(self.model.parameters()).device
        # A fill on the device, not a host-to-device copy: a captured step cannot record one.
        scale = torch.full((), 1.0 / microbatches, dtype=torch.float32, device=device)
        MoEAuxLossAutoScaler.set_loss_scale(scale)

    def graph_modules(self) -> Any:
        return self.model.modules()

    def graph_inputs(self, step: int, microbatches: list[dict[str, Any]]) -> dict[str, Any]:
        """The captured step's inputs: the one row's model inputs, labels and loss mask, and
        the step's loss denominator on the device (the row's host values left out)."""
        (mb,) = microbatches
        device = mb["input_ids"].device
        out = {k: mb[k] for k in (*MODEL_INPUTS, "labels", "loss_mask") if mb.get(k) is not None}
        out["denominator"] = self.denominator(microbatches).to(device)
        return out

    def graph_forward_backward(self, inputs: dict[str, Any]) -> torch.Tensor:
        """``forward_backward`` of one row from ``graph_inputs`` (no host read)."""
        from megatron.core import parallel_state as mps

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._scale_moe_aux_loss(1)
        loss = self.loss(inputs, inputs["denominator"])
        loss.backward()
        split = self.model.vision_split
        if split is not None:
            from longboat.vlm.models.vision_parallel import reduce_tower_grads

            reduce_tower_grads(self.model.vision, split)
        self.ddp.finish_grad_sync()
        total = loss.detach()
        dp = mps.get_data_parallel_world_size()
        if dp > 1:
            total = total.clone()
            dist.all_reduce(total, group=mps.get_data_parallel_group())
            total = total / dp
        return total

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict[str, Any]]) -> float:
        """Mean masked token loss of ``microbatches`` (this rank's; the caller reduces)."""
        if pipeline_parallel_size() > 1:
            return pipelined_evaluate(self, microbatches)
        self.model.eval()
        try:
            num = den = 0.0
            for mb in microbatches:
                per_token = self.model(**self._inputs(mb), labels=mb["labels"].clamp(min=0))
                mask = mb["loss_mask"].float()
                num += float((per_token.float() * mask).sum())
                den += float(mask.sum())
            return num / max(den, 1.0)
        finally:
            self.model.train()
