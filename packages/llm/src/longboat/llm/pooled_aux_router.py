"""transformers' pooled load-balancing loss on megatron's routers (``model.moe_aux_loss=hf``).

``PooledAuxRouter`` (swapped into the layer spec by ``longboat.llm.build.build_model``)
records, in each training forward, its layer's per-expert top-k counts and softmax
probability sums; ``pooled_aux_loss`` pools them over every layer once the forward is done
and returns ``E * sum_e f_e P_e`` (see ``longboat.llm.moe_aux_loss``). The shapes are static
and nothing is read on the host, so a CUDA-graph capture of the whole step holds it.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter

from longboat.llm.moe_aux_loss import KEY


class PooledAuxRouter(TopKRouter):
    """megatron's top-k router that, in a training forward, records what transformers' pooled
    load-balancing loss needs of this layer: per expert, how many top-k slots picked it and
    the sum of its softmax probability over the tokens."""

    aux_stats: tuple[torch.Tensor, torch.Tensor, int] | None = None
    """(top-k counts [E] int64, probability sums [E] fp32 with grad, tokens) of the last
    training forward; consumed (reset to None) by ``pooled_aux_loss``."""

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> Any:
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        if self.training and torch.is_grad_enabled():
            experts = self.config.num_moe_experts
            flat = logits.reshape(-1, experts)
            scores = torch.softmax(flat, dim=-1, dtype=torch.float32)
            # megatron's routing map already marks each token's top-k experts (dropless).
            counts = routing_map.reshape(-1, experts).sum(dim=0)
            self.aux_stats = (counts, scores.sum(dim=0), flat.shape[0])
        return probs, routing_map


def _routers(model: torch.nn.Module) -> list[PooledAuxRouter]:
    found = model.__dict__.get("_pooled_aux_routers")
    if found is None:  # walked once per chunk: the module tree does not change
        found = [m for m in model.modules() if isinstance(m, PooledAuxRouter)]
        model.__dict__["_pooled_aux_routers"] = found
    return found


def pooled_aux_loss(model: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """(transformers' load-balancing loss of ``model``'s last training forward, its
    coefficient), or None when the model has no ``PooledAuxRouter`` or the forward did not
    train (evaluation). Consumes the routers' records."""
    routers = _routers(model)
    if not routers or not model.training or not torch.is_grad_enabled():
        return None
    stats = [r.aux_stats for r in routers]
    if any(s is None for s in stats):
        raise RuntimeError(
            f"{KEY}=hf: a router recorded nothing in this training forward (was it run "
            "under activation recomputation?). Set model.moe_aux_loss=megatron."
        )
    for r in routers:
        r.aux_stats = None
    counts = torch.stack([s[0] for s in stats]).sum(dim=0)
    prob_sums = torch.stack([s[1] for s in stats]).sum(dim=0)
    rows = sum(s[2] for s in stats)
    return balance_loss(counts, prob_sums, rows), float(routers[0].config.moe_aux_loss_coeff)


def balance_loss(counts: torch.Tensor, prob_sums: torch.Tensor, rows: int) -> torch.Tensor:
    """``E * sum_e f_e P_e`` of per-expert top-k ``counts`` and probability sums over
    ``rows`` tokens (one layer's record, or several pooled)."""
    return counts.shape[0] * torch.sum((counts.float() / rows) * (prob_sums / rows))


__all__ = ["PooledAuxRouter", "balance_loss", "pooled_aux_loss"]
