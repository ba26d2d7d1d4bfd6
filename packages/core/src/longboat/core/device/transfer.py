"""Host-to-device copies that do not stall the host.

On CUDA a copy from pageable host memory waits for everything already queued on the stream
(the host blocks until the device catches up, then the device idles until the host queues
more); a copy from pinned memory is asynchronous, and torch's caching host allocator keeps
the pinned block alive until the copy has run. These helpers pin host tensors (unless they
already are) before a non-blocking copy to a CUDA device; elsewhere they are plain ``.to``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

__all__ = ["batch_to_device", "pins_host_memory", "to_device"]


def pins_host_memory(device: torch.device) -> bool:
    """Whether host tensors bound for ``device`` are pinned first (copies to CUDA)."""
    return device.type == "cuda"


def to_device(value: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """``value`` on ``device`` (a tensor, or a list / tuple of tensors; anything else as is),
    cast to ``dtype`` on the device when given."""
    if isinstance(value, torch.Tensor):
        if pins_host_memory(device) and value.device.type == "cpu":
            if not value.is_pinned():
                value = value.pin_memory()
            value = value.to(device, non_blocking=True)
        else:
            value = value.to(device)
        return value if dtype is None else value.to(dtype)
    if (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        return type(value)(to_device(v, device, dtype) for v in value)
    return value


def batch_to_device(
    batch: dict[str, Any], device: torch.device, *, keep_on_host: Collection[str] = ()
) -> dict[str, Any]:
    """Every tensor (or list of tensors) of ``batch`` on ``device``, except the keys in
    ``keep_on_host``; other values as they are."""
    return {k: v if k in keep_on_host else to_device(v, device) for k, v in batch.items()}
