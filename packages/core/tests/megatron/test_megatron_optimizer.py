"""core.megatron.optimizer helpers on megatron-shaped optimizer wrappers (CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")


def _wrapped(lr: float = 1e-3):
    """A megatron-like chained optimizer around two torch optimizers (AdamW + SGD)."""
    w = torch.nn.Parameter(torch.ones(4))
    b = torch.nn.Parameter(torch.zeros(2))
    adamw = torch.optim.AdamW([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=lr)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=lr)
    parts = [SimpleNamespace(optimizer=adamw), SimpleNamespace(optimizer=sgd)]
    return SimpleNamespace(chained_optimizers=parts), adamw, sgd


def test_capturable_adamw_puts_the_lr_in_a_device_tensor_the_scheduler_fills() -> None:
    from longboat.core.megatron.optimizer import capturable_torch_adamw

    opt, adamw, sgd = _wrapped(1e-3)
    # Parameters on CPU are left alone by default (capturable AdamW is a CUDA feature).
    assert capturable_torch_adamw(opt) == 0
    assert not adamw.param_groups[0].get("capturable")
    # The scheduler first (its initial_lr stays a Python float), then the switch.
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5**step)
    assert capturable_torch_adamw(opt, device_types=("cpu",)) == 2  # both AdamW groups
    lrs = [g["lr"] for g in adamw.param_groups]
    assert all(isinstance(x, torch.Tensor) and x.dtype == torch.float32 for x in lrs)
    assert all(g["capturable"] for g in adamw.param_groups)
    assert isinstance(sgd.param_groups[0]["lr"], float)  # not an Adam: untouched
    assert all(isinstance(g["initial_lr"], float) for g in adamw.param_groups)
    for step in range(1, 4):
        sched.step()
        for g, tensor in zip(adamw.param_groups, lrs):
            assert g["lr"] is tensor  # updated in place: a captured graph reads the new value
            assert float(tensor) == pytest.approx(1e-3 * 0.5**step, rel=1e-6)
    # idempotent: a second call keeps the same tensors
    assert capturable_torch_adamw(opt, device_types=("cpu",)) == 2
    assert all(g["lr"] is t for g, t in zip(adamw.param_groups, lrs))
