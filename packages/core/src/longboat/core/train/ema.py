"""An exponential moving average of a model's weights, for any stack (``ema.*``).

``EMAWeights`` keeps an fp32 copy of every floating-point parameter of the modules it is
given (this rank's tensor-parallel shards included: each rank averages what it holds) and,
after each optimizer step, moves it towards the weights:

- steps before ``ema.start_step``: the average is the weights (copied);
- then every ``ema.every`` steps: ``ema = decay * ema + (1 - decay) * weights``, in fp32
  whatever the weights' dtype (bf16 weights are averaged without rounding the average).

It is a checkpoint entry (``state_dict`` / ``load_state_dict``: the average, named like the
parameters, and the last step it saw), so a resumed run carries on the same average.
``swapped()`` puts the average into the model for the length of a ``with`` block (an export
with ``ema.export``) and the trained weights back afterwards, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["EMAWeights"]


class EMAWeights:
    """The fp32 average of ``params`` (name -> parameter) under ``cfg`` (an ``EMAConfig``).

    ``prefix``: put before every name in the state dict (e.g. a tensor-parallel rank's
    coordinates, when ranks hold different shards under the same names).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], cfg: Any, *, prefix: str = "") -> None:
        self.params = {n: p for n, p in params.items() if p.is_floating_point()}
        self.decay = float(cfg.decay)
        self.start_step = int(cfg.start_step)
        self.every = int(cfg.every)
        self.prefix = prefix
        self.average = {n: p.detach().to(torch.float32, copy=True) for n, p in self.params.items()}
        self.step = 0
        """The last optimizer step the average has seen (0: the starting weights)."""
        self.exported = bool(cfg.export)

    def describe(self) -> str:
        """One line for a run's description: the settings and what the export holds."""
        return (
            f"EMA of the weights (fp32): decay {self.decay:g} every {self.every} step(s) from "
            f"step {self.start_step}; the export holds "
            + ("the average." if self.exported else "the trained weights (ema.export=false).")
        )

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step ``step`` (1-based): copy or average the weights (module doc)."""
        self.step = step
        names = list(self.params)
        ours = [self.average[n] for n in names]
        theirs = [self.params[n].detach().float() for n in names]
        if step < self.start_step:
            torch._foreach_copy_(ours, theirs)
        elif step % self.every == 0:
            torch._foreach_lerp_(ours, theirs, 1.0 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        """The average (fp32, by ``prefix`` + parameter name) and the step it has seen."""
        return {
            "step": torch.tensor(self.step, dtype=torch.int64),
            **{f"{self.prefix}{n}": t for n, t in self.average.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the average and step of a checkpoint's ``state_dict`` (in place)."""
        missing = [n for n in self.average if f"{self.prefix}{n}" not in state]
        if missing:
            raise KeyError(f"the checkpoint's EMA lacks {missing[:3]} ({len(missing)} tensors)")
        for n, t in self.average.items():
            t.copy_(state[f"{self.prefix}{n}"])
        self.step = int(state["step"])

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside the block the parameters hold the average (in their dtype); afterwards
        the trained weights again, exactly."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        try:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(self.average[n])
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])
