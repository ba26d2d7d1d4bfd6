"""The optimizer of the Hugging Face / DiffSynth reference loops: ``torch.optim.AdamW`` (fused
on CUDA) at the run's ``optim`` settings, and one update as those loops take it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class ReferenceAdamW:
    """``update(i)`` after the backward: the LR ``optim.lr * lr_factor(i)`` (when given; else
    ``optim.lr`` throughout), ``clip_grad_norm_`` at ``clip`` (0: none), the AdamW step, the
    grads set to None.

    ``matrices_only``: weight decay on >= 2-D parameters only (the HF Trainer and longboat
    exempt biases and norm weights); else on every parameter."""

    def __init__(
        self,
        model: Any,
        optim: Any,
        device: torch.device,
        *,
        clip: float,
        lr_factor: Callable[[int], float] | None = None,
        matrices_only: bool = True,
    ) -> None:
        params: Any = list(model.parameters())
        if matrices_only:
            params = [
                {"params": [p for p in params if p.dim() >= 2]},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ]
        self.opt = torch.optim.AdamW(
            params,
            lr=optim.lr,
            betas=tuple(optim.betas),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=device.type == "cuda",
        )
        self.model, self.clip, self.lr, self.factor = model, clip, optim.lr, lr_factor

    def update(self, i: int = 0) -> None:
        if self.factor is not None:
            for group in self.opt.param_groups:
                group["lr"] = self.lr * self.factor(i)
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
