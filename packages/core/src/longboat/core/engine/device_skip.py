"""Skipping an optimizer update on the device: the part of the lagged NaN gate and the
CUDA-graph step that both step-engine backends share.

A 0-d fp32 ``found_inf`` on the device says whether this step's update is skipped (nonzero)
without the host reading anything: torch's fused Adam / AdamW read it in ``step()`` (their
foreach and for-loop versions refuse it), as do ``torch._fused_adamw_`` and longboat's
one-pass kernels. ``mark_non_finite`` sets it from the step's loss.
"""

from __future__ import annotations

import torch

GRAPH_WARMUP = 3
"""Eager steps before a CUDA-graph step is captured (both backends)."""


@torch.no_grad()
def mark_non_finite(found_inf: torch.Tensor, loss: torch.Tensor, *, keep: bool = False) -> None:
    """``found_inf = not isfinite(loss)``, on the device; ``keep``: ``found_inf |= ...`` (a
    skip already set, e.g. from a non-finite grad norm, stays)."""
    bad = torch.isfinite(loss.detach()).logical_not()
    if keep:
        torch.logical_or(found_inf, bad, out=found_inf)
        return
    found_inf.copy_(bad.to(found_inf.dtype).reshape(()).to(found_inf.device))


def install_found_inf(inners: list[torch.optim.Optimizer], found_inf: torch.Tensor) -> None:
    """Make each torch Adam / AdamW fused and read ``found_inf`` in its ``step()``."""
    for inner in inners:
        use_fused_adamw(inner)
        inner.found_inf = found_inf  # read by torch Adam's step()


def remove_found_inf(inners: list[torch.optim.Optimizer], found_inf: torch.Tensor) -> None:
    """Undo ``install_found_inf`` (a later plain ``step()`` steps)."""
    for inner in inners:
        if getattr(inner, "found_inf", None) is found_inf:
            del inner.found_inf


def use_fused_adamw(inner: torch.optim.Optimizer) -> None:
    """Switch every param group of a torch Adam / AdamW to the fused implementation (the one
    that honours ``found_inf``), with its step counts as fp32 tensors on the param's device
    (what fused AdamW keeps; a non-fused state from a checkpoint holds them on the CPU)."""
    for group in inner.param_groups:
        group["fused"], group["foreach"] = True, False
        for p in group["params"]:
            state = inner.state.get(p)
            if state and "step" in state:
                step = state["step"]
                if not isinstance(step, torch.Tensor):
                    step = torch.tensor(float(step))
                state["step"] = step.to(dtype=torch.float32, device=p.device)
