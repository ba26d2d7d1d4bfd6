"""The VLM step over pipeline stages, through megatron-core's 1F1B schedule.

Every stage reads the same microbatches (the rows come from the batch, not from the
previous stage): the first stage runs the vision tower and the embedding, every stage
computes its M-RoPE position ids and packed attention mask from the row, and the last
stage turns the decoder's per-token losses into the step's loss. Packed rows all hold
``data.seq_len`` tokens, so the hidden states sent between stages have one fixed shape
``[seq_len, 1, hidden]`` (megatron's ``pipeline_dtype``).

The loss and its scaling are those of the loop without pipelining: each microbatch
contributes the sum of its masked token losses over the global batch's token count (over
the data-parallel size, which megatron's DDP averages over). megatron divides what a loss
function returns by the number of microbatches, so the function hands it back multiplied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist


def check_pipeline(
    parallel: Any, model_cfg: Any, frozen: Sequence[str] = (), *, family: Any = None
) -> None:
    """Raise ``ConfigError`` naming each pipeline setting the model cannot run with (before
    the data and the model are built): a ``family`` (``VLMFamily``) whose module does not set
    ``PIPELINE_PARALLEL = True`` (its ``build`` / ``load_hf`` / ``save_hf`` are not
    stage-aware), interleaved virtual
    stages, a stage count that does not divide the decoder's layers, a first stage without
    every layer that takes deepstack features, a frozen decoder (the later stages would train
    nothing)."""
    from longboat.core.config.errors import ConfigError, ConfigProblem

    pp, vpp = parallel.pipeline_parallel, parallel.virtual_pipeline_parallel
    problems = []
    if pp > 1 and family is not None and not getattr(family.load(), "PIPELINE_PARALLEL", False):
        problems.append(
            ConfigProblem(
                key="parallel.pipeline_parallel",
                value=pp,
                message=f"the {family.name} family does not support pipeline parallelism yet",
                fix="set parallel.pipeline_parallel=1",
            )
        )
    if vpp is not None and vpp > 1:
        problems.append(
            ConfigProblem(
                key="parallel.virtual_pipeline_parallel",
                value=vpp,
                message="interleaved virtual pipeline stages are not supported by longboat-vlm",
                fix="set it to null (1F1B over parallel.pipeline_parallel stages)",
            )
        )
    layers = model_cfg.language.num_layers
    if pp > 1 and layers % pp:
        problems.append(
            ConfigProblem(
                key="parallel.pipeline_parallel",
                value=pp,
                message=f"must divide the decoder's num_layers={layers} (an equal share per stage)",
                fix=f"use one of {[d for d in range(1, layers + 1) if layers % d == 0]}",
            )
        )
    deepstack = len(getattr(model_cfg.vision, "deepstack_visual_indexes", ()))
    if pp > 1 and layers // pp < deepstack:
        problems.append(
            ConfigProblem(
                key="parallel.pipeline_parallel",
                value=pp,
                message=f"the first stage would hold {layers // pp} decoder layers, but the "
                f"vision tower's {deepstack} deepstack features go into the first {deepstack} "
                "(the tower lives on the first stage)",
                fix="use fewer stages",
            )
        )
    if pp > 1 and "language" in frozen:
        problems.append(
            ConfigProblem(
                key="model.freeze",
                value=list(frozen),
                message="freezes the decoder, so pipeline stages after the first train nothing",
                fix="unfreeze language or set parallel.pipeline_parallel=1",
            )
        )
    if problems:
        raise ConfigError(problems)


def pipeline_parallel_size() -> int:
    """The number of pipeline stages of megatron's live parallel state."""
    from megatron.core import parallel_state as mps

    return mps.get_pipeline_model_parallel_world_size()


def _schedule(
    model: torch.nn.Module,
    microbatches: list[dict[str, Any]],
    inputs: Callable[[dict[str, Any]], dict[str, Any]],
    loss_func: Callable[..., Any],
    *,
    forward_only: bool,
) -> list[dict[str, torch.Tensor]]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    shapes = {tuple(mb["input_ids"].shape) for mb in microbatches}
    if len(shapes) != 1:
        raise ValueError(
            f"pipeline stages exchange one activation shape, but the microbatches have input_ids "
            f"of shapes {sorted(shapes)}: pad every row to data.seq_len tokens"
        )
    ((batch, seq),) = shapes

    def forward_step(data_iterator: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        output = chunk(**inputs(mb), labels=mb["labels"].clamp(min=0))
        return output, partial(loss_func, mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq,
        micro_batch_size=batch,
        forward_only=forward_only,
    )


def from_last_stage(value: torch.Tensor) -> torch.Tensor:
    """``value`` of the last pipeline stage, on every stage of this pipeline (collective
    over the pipeline group)."""
    from megatron.core import parallel_state as mps

    value = value.contiguous()
    dist.broadcast(
        value,
        src=mps.get_pipeline_model_parallel_last_rank(),
        group=mps.get_pipeline_model_parallel_group(),
    )
    return value


def pipelined_forward_backward(
    step: Any, microbatches: list[dict[str, Any]], denominator: torch.Tensor
) -> torch.Tensor:
    """Forward and backward of ``microbatches`` over the stages, then megatron's grad
    finalisation (data-parallel reduction, the tied embedding's grads summed between the
    first and last stage). Returns this rank's loss sum (zero before the last stage)."""
    from megatron.core import parallel_state as mps
    from megatron.core.distributed import finalize_model_grads

    n = len(microbatches)
    device = microbatches[0]["input_ids"].device

    def loss_func(
        mb: dict[str, Any], per_token: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb["loss_mask"].to(per_token.dtype)
        loss = (per_token.float() * mask.float()).sum() / denominator.to(per_token.device)
        return loss * n, {"loss": loss.detach().clone()}

    losses = _schedule(step.ddp, microbatches, step._inputs, loss_func, forward_only=False)
    finalize_model_grads([step.ddp])
    if mps.is_pipeline_last_stage() and losses:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for out in losses:
            total = total + out["loss"].to(device)
        return total
    return torch.zeros((), dtype=torch.float32, device=device)


@torch.no_grad()
def pipelined_evaluate(step: Any, microbatches: list[dict[str, Any]]) -> float:
    """Mean masked token loss of ``microbatches`` (forward only over the stages), known on
    every stage of this pipeline."""
    from megatron.core import parallel_state as mps

    def loss_func(
        mb: dict[str, Any], per_token: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb["loss_mask"].float()
        num = (per_token.float() * mask).sum()
        return num.clone(), {"num": num, "den": mask.sum()}

    step.model.eval()
    try:
        outs = _schedule(step.model, microbatches, step._inputs, loss_func, forward_only=True)
    finally:
        step.model.train()
    device = microbatches[0]["input_ids"].device
    mean = torch.zeros((), dtype=torch.float64, device=device)
    if mps.is_pipeline_last_stage() and outs:
        num = sum(float(o["num"]) for o in outs)
        den = sum(float(o["den"]) for o in outs)
        mean = torch.tensor(num / max(den, 1.0), dtype=torch.float64, device=device)
    return float(from_last_stage(mean))
