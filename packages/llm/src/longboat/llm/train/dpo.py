"""Direct preference optimisation (``llm.objective=dpo``): the loss, its megatron forward
step, and the reference model's log-probabilities.

A microbatch of ``P`` pairs is one ``[2P, s]`` batch, the ``P`` chosen conversations then the
``P`` rejected ones (``dpo_data.PreferenceRows``), so one forward serves both. megatron's
``GPTModel`` given labels returns the per-token cross-entropy ``[2P, s]`` (its logits path:
vocab-parallel under tensor parallelism); minus its sum over the answer tokens
(``loss_mask``: the prompt is masked) is each conversation's answer log-probability. The loss
(Rafailov et al., 2023) over the pairs of a microbatch is::

    mean(-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))))

The reference log-probabilities ``ref_c`` / ``ref_r`` are those of the run's initial weights
(``llm.dpo.reference=initial``), computed in one forward-only pass over every pair before the
first step (``compute_reference_logps``) rather than by a frozen copy of the model inside
each step. The reference model never changes, so its log-probability of a pair is the same
number every epoch: the one pass costs one forward per pair for the whole run, where a
frozen copy costs one extra forward per pair per step (about half again a step's compute)
and a second copy of the weights in device memory. The pass runs through the policy model
itself before its first update, with the same parallel layout and microbatch shape as the
steps, so at step 0 the policy's log-probabilities equal the reference's and the loss is
``ln 2``. The table (``ReferenceLogps``, two fp32 numbers a pair) is kept in every
checkpoint: a resumed run reads it back instead of needing the initial weights again.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from longboat.llm.train.megatron_schedule import StepObjective

METRICS = {
    "reward_accuracy": "reward accuracy",
    "reward_margin": "reward margin",
    "chosen_reward": "chosen reward",
    "rejected_reward": "rejected reward",
}
"""What a DPO step reports beside its loss (metric name -> key of the loss function's
report): the share of pairs whose chosen reward is above the rejected one, the mean margin
between them, and the mean implicit rewards ``beta * (pi - ref)`` of each side."""


def sequence_logps(token_losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability over the tokens ``loss_mask`` keeps, from the
    per-token cross-entropy ``[b, s]`` (the negative log-probability of each label); fp32
    ``[b]``."""
    return -(token_losses.float() * loss_mask.float()).sum(dim=1)


def dpo_loss(
    logps: torch.Tensor, ref_logps: torch.Tensor, beta: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DPO loss (mean over pairs) of ``[2P]`` answer log-probabilities, chosen first,
    and the reference's for the same rows; and its statistics (``METRICS``' keys, 0-d)."""
    pairs = logps.shape[0] // 2
    rewards = beta * (logps.float() - ref_logps.float())
    chosen, rejected = rewards[:pairs], rewards[pairs:]
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()
    stats = {
        "reward accuracy": (chosen > rejected).float().mean(),
        "reward margin": margin.mean(),
        "chosen reward": chosen.mean(),
        "rejected reward": rejected.mean(),
    }
    return loss, {k: v.detach() for k, v in stats.items()}


def _dpo_loss_func(
    loss_mask: torch.Tensor,
    ref_logps: torch.Tensor,
    beta: float,
    output: torch.Tensor,
    aux: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss, stats = dpo_loss(sequence_logps(output, loss_mask), ref_logps, beta)
    # clone: megatron divides the returned loss in place by the number of microbatches.
    reported = {"dpo loss": loss.detach().clone(), **stats}
    if aux is not None:  # model.moe_aux_loss=hf: the pooled load-balancing loss, as for lm
        value, coeff = aux
        loss = loss + coeff * value
    return loss, reported


def _forward(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )


def dpo_forward_step(
    data_iterator: Any, model: torch.nn.Module, *, beta: float
) -> tuple[torch.Tensor, Any]:
    """megatron's ``forward_step_func`` of a DPO step (batches carry ``ref_logps``)."""
    from longboat.llm.pooled_aux_router import pooled_aux_loss  # imports megatron's router

    batch = next(data_iterator)
    output = _forward(model, batch)
    loss_func = partial(_dpo_loss_func, batch["loss_mask"], batch["ref_logps"], beta)
    return output, partial(loss_func, aux=pooled_aux_loss(model))


def dpo_objective(beta: float) -> StepObjective:
    """The DPO objective of ``TrainStep`` (``llm.dpo.beta``)."""
    return StepObjective(partial(dpo_forward_step, beta=beta), "dpo loss", dict(METRICS))


def _logps_loss_func(
    loss_mask: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logps = sequence_logps(output, loss_mask).detach()
    return logps.sum(), {"logps": logps.clone()}


def _logps_forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    return _forward(model, batch), partial(_logps_loss_func, batch["loss_mask"])


def compute_reference_logps(
    model: list[torch.nn.Module],
    rows: Any,
    pairs_per_microbatch: int,
    device: torch.device,
    *,
    dp_rank: int = 0,
    dp_size: int = 1,
    dp_group: Any = None,
) -> torch.Tensor:
    """``[N, 2]`` fp32 (chosen, rejected) answer log-probabilities of every pair of ``rows``
    under ``model``'s current weights, on ``device``.

    Microbatches of ``pairs_per_microbatch`` pairs, the shape the steps use (the last one
    filled up with pairs from the start, whose values are dropped); microbatch ``k`` is DP
    rank ``k % dp_size``'s, and one all-reduce over ``dp_group`` gives every rank the whole
    table. Known on the last pipeline stage (zeros elsewhere: only it computes the loss).
    """
    import torch.distributed as dist

    from longboat.core.device.transfer import batch_to_device
    from longboat.llm.train.megatron_schedule import forward_only

    n, p = len(rows), pairs_per_microbatch
    table = torch.zeros(n, 2, dtype=torch.float32, device=device)
    starts = list(range(0, n, p))[dp_rank::dp_size]
    micro = [batch_to_device(rows.microbatch(np.arange(s, s + p) % n), device) for s in starts]
    reported = forward_only(model, micro, _logps_forward_step) if micro else []
    for start, out in zip(starts, reported, strict=False):
        logps = out["logps"].to(device)
        keep = min(p, n - start)
        table[start : start + keep, 0] = logps[:keep]
        table[start : start + keep, 1] = logps[p : p + keep]
    if dp_size > 1 and dist.is_initialized():
        dist.all_reduce(table, group=dp_group)
    return table


class ReferenceLogps:
    """The reference model's log-probabilities of every pair (a checkpoint entry: a resumed
    run reads them back). ``table`` is ``[N, 2]`` fp32 on the device, None until computed."""

    def __init__(self, num_pairs: int) -> None:
        self.num_pairs = num_pairs
        self.table: torch.Tensor | None = None

    def lookup(self, pair_index: torch.Tensor) -> torch.Tensor:
        """``[2P]``: the chosen values of ``pair_index``'s pairs, then the rejected ones."""
        assert self.table is not None, "the reference log-probabilities are not computed yet"
        ref = self.table[pair_index.to(self.table.device)]
        return torch.cat([ref[:, 0], ref[:, 1]])

    def state_dict(self) -> dict[str, Any]:
        return {"logps": None if self.table is None else self.table.detach().cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from longboat.core.checkpoint import CheckpointError

        logps = state.get("logps")
        if logps is None:
            self.table = None
            return
        if tuple(logps.shape) != (self.num_pairs, 2):
            raise CheckpointError(
                f"the checkpoint's DPO reference log-probabilities are for {logps.shape[0]} "
                f"pairs, the data has {self.num_pairs}: it was written for other data.paths "
                "(resume with the same data, or checkpoint.resume=none to start over)"
            )
        device = self.table.device if self.table is not None else None
        self.table = logps.to(device) if device is not None else logps


__all__ = [
    "METRICS",
    "ReferenceLogps",
    "compute_reference_logps",
    "dpo_forward_step",
    "dpo_loss",
    "dpo_objective",
    "sequence_logps",
]
