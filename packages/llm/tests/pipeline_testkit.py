"""Forward / train steps through megatron's pipeline schedules (any TP / PP / VPP / EP)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _position_ids(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """All-gather vocab-parallel logits ``[..., V/tp]`` into ``[..., V]``."""
    from megatron.core import parallel_state as mps

    tp = mps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=mps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _run_schedule(
    chunks: list[torch.nn.Module],
    microbatches: list[dict[str, torch.Tensor]],
    loss_fn: Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, dict]],
    *,
    forward_only: bool,
) -> list[dict[str, Any]]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    it = iter(microbatches)

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        tokens = batch["tokens"]
        out = model(tokens, _position_ids(tokens), None, labels=batch.get("labels"))
        return out, lambda output: loss_fn(batch, output)

    seq = microbatches[0]["tokens"].shape[1]
    mbs = microbatches[0]["tokens"].shape[0]
    data: Any = it if len(chunks) == 1 else [iter(microbatches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq,
        micro_batch_size=mbs,
        forward_only=forward_only,
    )


@torch.no_grad()
def forward_logits(
    chunks: list[torch.nn.Module], tokens: torch.Tensor, *, micro_batch_size: int = 1
) -> torch.Tensor | None:
    """Full-vocab logits ``[b, s, V]`` on the last pipeline stage, None on other stages.

    The batch runs as ``b / micro_batch_size`` microbatches (interleaved pipelines need at
    least as many microbatches as pipeline stages).
    """
    from megatron.core import parallel_state as mps

    for c in chunks:
        c.eval()
    captured: list[torch.Tensor] = []

    def loss_fn(batch: dict[str, torch.Tensor], output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        captured.append(gather_vocab(output))
        return output.sum() * 0.0, {}

    micro = [{"tokens": t} for t in tokens.split(micro_batch_size)]
    _run_schedule(chunks, micro, loss_fn, forward_only=True)
    return torch.cat(captured, 0) if mps.is_pipeline_last_stage() else None


def lm_loss_fn(
    batch: dict[str, torch.Tensor], output: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean token cross-entropy from megatron's per-token losses ``[b, s]``."""
    loss = output.float().mean()
    # clone: megatron divides the returned loss by num_microbatches in place.
    return loss, {"lm loss": loss.detach().clone()}


def train_step(
    chunks: list[torch.nn.Module],
    optimizer: Any,
    microbatches: list[dict[str, torch.Tensor]],
) -> tuple[float | None, float]:
    """One optimizer step over ``microbatches``.

    Returns ``(mean loss on the last pipeline stage or None elsewhere, global grad norm)``.
    """
    from megatron.core import parallel_state as mps

    for c in chunks:
        c.train()
        if hasattr(c, "zero_grad_buffer"):
            c.zero_grad_buffer()
    optimizer.zero_grad()
    losses = _run_schedule(chunks, microbatches, lm_loss_fn, forward_only=False)
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(chunks if isinstance(chunks, list) else [chunks])
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("optimizer step was skipped (non-finite gradients)")
    norm = float(grad_norm) if grad_norm is not None else float("nan")
    if not mps.is_pipeline_last_stage():
        return None, norm
    return float(torch.stack([d["lm loss"] for d in losses]).mean()), norm
