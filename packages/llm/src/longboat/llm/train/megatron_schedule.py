"""One training / evaluation step through megatron-core's pipeline schedules.

``get_forward_backward_func`` picks the schedule for the live parallel state (no pipeline,
1F1B, or interleaved 1F1B with virtual stages); the loss of a microbatch is the mean
cross-entropy over its ``loss_mask`` tokens, and megatron divides it by the number of
microbatches, so gradients are those of the mean over the global batch's microbatches.
With ``fused_ce`` the loss comes from fused linear cross-entropy through ``GPTModel``'s
``output_processor`` hook (``train.loss``; no ``[tokens, vocab]`` logits) wherever it applies.

The step's loss stays on the device (``forward_backward`` returns a tensor): reading it on
the host is a device sync, which the loop does only where it needs the value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from longboat.llm.train.loss import fused_lm_loss, fused_loss_applies


@dataclass(frozen=True)
class StepObjective:
    """A training objective other than the LM loss, run through megatron's schedules: its
    ``forward_step`` (megatron's ``forward_step_func``: ``(data_iterator, model) -> (output,
    loss_func)``, the loss function returning ``(loss, reported)``), the key of ``reported``
    that is the step's loss, and the metrics (name -> key of ``reported``) a step reports."""

    forward_step: Callable[..., Any]
    loss_key: str
    metric_keys: dict[str, str] = field(default_factory=dict)


def masked_lm_loss(
    loss_mask: torch.Tensor | None,
    output: torch.Tensor,
    aux: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean of megatron's per-token losses ``[b, s]`` over the tokens ``loss_mask`` keeps.

    A scalar ``output`` is already that mean (the fused loss path); ``loss_mask=None`` keeps
    every token. ``aux``: (transformers' MoE load-balancing loss, its coefficient)
    (``model.moe_aux_loss=hf``): the loss optimised is ``lm + coeff * aux``; the reported
    ``lm loss`` stays the LM term and ``moe aux loss`` is ``aux``.
    """
    if output.dim() == 0:
        loss = output.float()
    else:
        losses = output.float()
        if loss_mask is None:
            loss = losses.mean()
        else:
            loss = (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
    # clone: megatron divides the returned loss in place by the number of microbatches.
    reported = {"lm loss": loss.detach().clone()}
    if aux is not None:
        value, coeff = aux
        reported["moe aux loss"] = value.detach().clone()
        loss = loss + coeff * value
    return loss, reported


def _forward_step(
    data_iterator: Any, model: torch.nn.Module, *, fused_ce: bool = False
) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    kwargs: dict[str, Any] = {}
    if fused_ce and fused_loss_applies(model):
        kwargs = {"output_processor": fused_lm_loss, "output_processor_context": batch["loss_mask"]}
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        **kwargs,
    )
    from longboat.llm.pooled_aux_router import pooled_aux_loss  # imports megatron's router

    # model.moe_aux_loss=hf: every layer's router records of this forward, pooled.
    aux = pooled_aux_loss(model)
    return output, partial(masked_lm_loss, batch["loss_mask"], aux=aux)


def _schedule(
    model: list[torch.nn.Module],
    microbatches: list[dict[str, Any]],
    *,
    forward_only: bool,
    fused_ce: bool = False,
    forward_step: Any = None,
) -> list[dict[str, torch.Tensor]]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data: Any = iter(microbatches) if len(model) == 1 else [iter(microbatches) for _ in model]
    tokens = microbatches[0]["tokens"]
    return get_forward_backward_func()(
        forward_step_func=forward_step or partial(_forward_step, fused_ce=fused_ce),
        data_iterator=data,
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(microbatches),
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=forward_only,
    )


def world_mean_of_last_stage(
    values: list[dict[str, torch.Tensor]],
    device: torch.device | None = None,
    key: str = "lm loss",
) -> torch.Tensor:
    """The mean microbatch loss, averaged over data-parallel ranks, known on every rank.

    Losses exist on the last pipeline stage only (identical on its TP ranks); one all-reduce
    over the world sums them with a count, so rank 0 can log them. A 0-d fp64 device tensor
    (NaN when no stage had losses); ``float()`` of it is the host read.
    """
    from megatron.core import parallel_state as mps

    # On the accelerator: NCCL-like backends reduce device tensors only.
    # Built from device tensors only: writing a Python number into a device tensor is a
    # host-to-device copy, which synchronises (and breaks a CUDA-graph capture of the step).
    if mps.is_pipeline_last_stage() and values:
        mean = torch.stack([v[key].double().to(device) for v in values]).mean()
        local = torch.stack([mean, torch.ones_like(mean)])
    else:
        local = torch.zeros(2, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local)
    return local[0] / local[1]  # 0 / 0 = NaN when no rank had losses


def forward_backward(
    model: list[torch.nn.Module],
    microbatches: list[dict[str, Any]],
    device: torch.device | None = None,
    *,
    fused_ce: bool = False,
    metrics: dict[str, torch.Tensor] | None = None,
    objective: Any = None,
) -> torch.Tensor:
    """Zero the grads, run forward + backward over ``microbatches``, reduce the grads.

    Returns the step's mean LM loss on every rank as a 0-d device tensor (no host sync). The
    optimizer step is the caller's, so a non-finite loss can skip it. ``metrics``, when
    given, receives ``moe_aux_loss`` (the mean of transformers' load-balancing loss,
    ``model.moe_aux_loss=hf``) where the model computes it, and ``mtp_loss`` (the
    multi-token prediction loss, ``mtp_mean_loss``) for a model with multi-token prediction,
    and ``indexer_loss`` (``indexer_mean_loss``) for sparse attention with an indexer loss.
    ``objective`` (a ``StepObjective``) replaces the LM forward step and loss: the step's
    loss is the mean of its ``loss_key`` and ``metrics`` receives its ``metric_keys``.
    """
    from megatron.core.distributed import finalize_model_grads

    for chunk in model:
        chunk.train()
        chunk.zero_grad_buffer()
    step_fn = objective.forward_step if objective is not None else None
    indexer_layers = _indexer_loss_layers(model, device)
    losses = _schedule(
        model, microbatches, forward_only=False, fused_ce=fused_ce, forward_step=step_fn
    )
    finalize_model_grads(model)
    if indexer_layers:
        indexer = indexer_mean_loss(indexer_layers, len(microbatches), device)
        if metrics is not None:
            metrics["indexer_loss"] = indexer
    if objective is not None:
        if metrics is not None:
            for name, key in objective.metric_keys.items():
                metrics[name] = world_mean_of_last_stage(losses, device, key)
        return world_mean_of_last_stage(losses, device, objective.loss_key)
    if metrics is not None and losses and "moe aux loss" in losses[0]:
        metrics["moe_aux_loss"] = world_mean_of_last_stage(losses, device, "moe aux loss")
    if _mtp_depths(model):
        mtp = mtp_mean_loss(len(microbatches), device)
        if metrics is not None:
            metrics["mtp_loss"] = mtp
    return world_mean_of_last_stage(losses, device)


def _model_config(model: list[torch.nn.Module]) -> Any:
    inner: Any = model[0]
    while not hasattr(inner, "config") and hasattr(inner, "module"):
        inner = inner.module
    return getattr(inner, "config", None)


def _mtp_depths(model: list[torch.nn.Module]) -> int:
    """The model's multi-token prediction depth (megatron's ``mtp_num_layers``; 0: none)."""
    return int(getattr(_model_config(model), "mtp_num_layers", None) or 0)


def _indexer_loss_layers(model: list[torch.nn.Module], device: torch.device | None) -> int:
    """Layers whose sparse attention adds an indexer loss (0: none). megatron's indexer-loss
    tracker is seated here, on the step's device, before the forward passes fill it."""
    config = _model_config(model)
    if getattr(config, "experimental_attention_variant", None) != "dsa":
        return 0
    if not getattr(config, "dsa_indexer_loss_coeff", None):
        return 0
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    layers = int(config.num_layers)
    DSAIndexerLossLoggingHelper.tracker.update(
        values=torch.zeros(layers, device=device), reduce_group=None, avg_group=None
    )
    return layers


def indexer_mean_loss(
    layers: int, microbatches: int, device: torch.device | None = None
) -> torch.Tensor:
    """The step's indexer loss (its weighted KL, mean over layers and microbatches, averaged
    over data-parallel ranks) from megatron's tracker, emptied for the next step
    (collective: every rank calls it)."""
    from megatron.core import parallel_state as mps
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )

    values = DSAIndexerLossLoggingHelper.tracker.pop("values", None)
    # Each pipeline stage tracks its own layers; tensor-parallel ranks hold the same values.
    local = torch.zeros((), dtype=torch.float64, device=device)
    if values is not None and mps.get_tensor_model_parallel_rank() == 0:
        local = values.double().sum().to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local)
    replicas = mps.get_data_parallel_world_size(with_context_parallel=True)
    return local / (layers * microbatches * replicas)


def mtp_mean_loss(microbatches: int, device: torch.device | None = None) -> torch.Tensor:
    """The step's multi-token prediction loss (mean over depths and microbatches, averaged
    over data-parallel ranks) from megatron's MTP tracker, which is emptied for the next step
    (collective: every rank calls it)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = tracker.pop("loss_values", None)
    for key in ("correct_values", "total_values"):
        tracker.pop(key, None)
    entries = (
        [] if values is None else [{"mtp loss": values.sum() / (values.numel() * microbatches)}]
    )
    return world_mean_of_last_stage(entries, device, "mtp loss")


@torch.no_grad()
def forward_only(
    model: list[torch.nn.Module], microbatches: list[dict[str, Any]], forward_step: Any
) -> list[dict[str, torch.Tensor]]:
    """What ``forward_step``'s loss function reports for each of ``microbatches`` (forward
    only, the chunks in eval mode; on the last pipeline stage, an empty list elsewhere)."""
    for chunk in model:
        chunk.eval()
    try:
        return _schedule(model, microbatches, forward_only=True, forward_step=forward_step)
    finally:
        for chunk in model:
            chunk.train()


@torch.no_grad()
def evaluate(
    model: list[torch.nn.Module],
    microbatches: list[dict[str, Any]],
    device: torch.device | None = None,
    *,
    fused_ce: bool = False,
) -> float:
    """Mean held-out loss over ``microbatches`` (forward only), on every rank."""
    for chunk in model:
        chunk.eval()
    losses = _schedule(model, microbatches, forward_only=True, fused_ce=fused_ce)
    for chunk in model:
        chunk.train()
    return float(world_mean_of_last_stage(losses, device))
