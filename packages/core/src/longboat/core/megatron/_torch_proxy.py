"""A ``torch`` stand-in that routes megatron-core's CUDA calls to an accelerator.

megatron-core writes ``torch.cuda.current_device()``, ``torch.cuda.synchronize()``,
``torch.cuda.get_rng_state()`` and ``torch.zeros(..., device="cuda")`` directly.
The adapter replaces the module global ``torch`` of the affected megatron
modules with an ``AcceleratorTorch``: every attribute is the real torch one,
except ``cuda`` (an ``AcceleratorCudaNamespace`` answering through the
longboat accelerator) and the tensor factories, which map a CUDA ``device``
argument to the accelerator's device.  Nothing outside those modules changes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_strided",
)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare ordinal means "cuda:<n>" in torch's factories
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class _Nvtx:
    """No-op NVTX ranges."""

    @staticmethod
    def range_push(msg: str) -> None:
        return None

    @staticmethod
    def range_pop() -> None:
        return None

    @staticmethod
    def range(msg: str, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class _RandomNamespace:
    def __init__(self, cuda: AcceleratorCudaNamespace) -> None:
        self._cuda = cuda

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self._cuda.get_rng_state(device)

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        self._cuda.set_rng_state(new_state, device)

    def manual_seed(self, seed: int) -> None:
        self._cuda.manual_seed(seed)


class AcceleratorCudaNamespace:
    """The subset of ``torch.cuda`` that megatron-core uses, answered by an accelerator."""

    def __init__(self, accelerator: Any) -> None:
        self._acc = accelerator
        self.random = _RandomNamespace(self)
        self.nvtx = _Nvtx()
        self.amp = torch.amp

    def is_available(self) -> bool:
        return bool(type(self._acc).is_available())

    def current_device(self) -> torch.device:
        return self._acc.device()

    def device_count(self) -> int:
        return int(self._acc.device_count())

    def set_device(self, index: int) -> None:
        self._acc.set_device(index)

    def synchronize(self, device: Any = None) -> None:
        self._acc.synchronize()

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self._acc.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        self._acc.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> None:
        self._acc.manual_seed(seed)

    manual_seed_all = manual_seed

    def current_stream(self, device: Any = None) -> Any:
        return self._acc.current_stream()

    def Stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._acc.stream()

    def stream(self, s: Any) -> contextlib.AbstractContextManager[Any]:
        return self._acc.use_stream(s)

    def Event(self, enable_timing: bool = False, **kwargs: Any) -> Any:
        return self._acc.event(enable_timing=enable_timing)

    def empty_cache(self) -> None:
        self._acc.empty_cache()

    def memory_allocated(self, device: Any = None) -> int:
        return int(self._acc.memory_stats().get("allocated_gb", 0.0) * 2**30)

    def max_memory_allocated(self, device: Any = None) -> int:
        return int(self._acc.memory_stats().get("peak_allocated_gb", 0.0) * 2**30)

    def memory_reserved(self, device: Any = None) -> int:
        return int(self._acc.memory_stats().get("reserved_gb", 0.0) * 2**30)

    def is_current_stream_capturing(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"torch.cuda.{name} is not routed to the {getattr(self._acc, 'name', '?')!r} "
            "accelerator by longboat's megatron adapter; add it to AcceleratorCudaNamespace."
        )


class AcceleratorTorch:
    """Module-global ``torch`` replacement for patched megatron modules."""

    def __init__(self, accelerator: Any) -> None:
        self._acc = accelerator
        self.cuda = AcceleratorCudaNamespace(accelerator)
        for name in _FACTORIES:
            setattr(self, name, self._wrap_factory(getattr(torch, name)))

    def _wrap_factory(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        acc = self._acc

        @functools.wraps(fn)
        def factory(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                kwargs["device"] = acc.device()
            return fn(*args, **kwargs)

        return factory

    def autocast(self, device_type: str, *args: Any, **kwargs: Any) -> Any:
        if device_type == "cuda":
            device_type = self._acc.device_type
        return torch.autocast(device_type, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)
