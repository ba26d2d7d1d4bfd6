"""One training / evaluation step through megatron-core's pipeline schedules.

``get_forward_backward_func`` picks the schedule for the live parallel state (no pipeline,
1F1B, or interleaved 1F1B with virtual stages); the loss of a microbatch is the mean
cross-entropy over its ``loss_mask`` tokens, and megatron divides it by the number of
microbatches, so gradients are those of the mean over the global batch's microbatches.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist


def masked_lm_loss(
    loss_mask: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean of megatron's per-token losses ``[b, s]`` over the tokens ``loss_mask`` keeps."""
    losses = output.float()
    loss = (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
    # clone: megatron divides the returned loss in place by the number of microbatches.
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, partial(masked_lm_loss, batch["loss_mask"])


def _schedule(
    model: list[torch.nn.Module], microbatches: list[dict[str, Any]], *, forward_only: bool
) -> list[dict[str, torch.Tensor]]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data: Any = iter(microbatches) if len(model) == 1 else [iter(microbatches) for _ in model]
    tokens = microbatches[0]["tokens"]
    return get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=data,
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(microbatches),
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=forward_only,
    )


def world_mean_of_last_stage(
    values: list[dict[str, torch.Tensor]], device: torch.device | None = None
) -> float:
    """The mean microbatch loss, averaged over data-parallel ranks, known on every rank.

    Losses exist on the last pipeline stage only (identical on its TP ranks); one all-reduce
    over the world sums them with a count, so rank 0 can log them.
    """
    from megatron.core import parallel_state as mps

    # On the accelerator: NCCL-like backends reduce device tensors only.
    local = torch.zeros(2, dtype=torch.float64, device=device)
    if mps.is_pipeline_last_stage() and values:
        local[0] = torch.stack([v["lm loss"].double().to(local.device) for v in values]).mean()
        local[1] = 1.0
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local)
    return float(local[0] / local[1]) if local[1] > 0 else float("nan")


def forward_backward(
    model: list[torch.nn.Module],
    microbatches: list[dict[str, Any]],
    device: torch.device | None = None,
) -> float:
    """Zero the grads, run forward + backward over ``microbatches``, reduce the grads.

    Returns the step's mean loss on every rank. The optimizer step is the caller's, so a
    non-finite loss can skip it.
    """
    from megatron.core.distributed import finalize_model_grads

    for chunk in model:
        chunk.train()
        chunk.zero_grad_buffer()
    losses = _schedule(model, microbatches, forward_only=False)
    finalize_model_grads(model)
    return world_mean_of_last_stage(losses, device)


@torch.no_grad()
def evaluate(
    model: list[torch.nn.Module],
    microbatches: list[dict[str, Any]],
    device: torch.device | None = None,
) -> float:
    """Mean held-out loss over ``microbatches`` (forward only), on every rank."""
    for chunk in model:
        chunk.eval()
    losses = _schedule(model, microbatches, forward_only=True)
    for chunk in model:
        chunk.train()
    return world_mean_of_last_stage(losses, device)
