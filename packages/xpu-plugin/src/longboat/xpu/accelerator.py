"""The Kunlun XPU accelerator, registered with longboat through the entry point
``longboat.accelerators: xpu = longboat.xpu.accelerator:KunlunXPUAccelerator``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from longboat.core.device import Accelerator, AcceleratorUnavailableError
from longboat.xpu.runtime import INSTALL_HINT, XPURuntime, detect_runtime

_GB = float(1 << 30)


class KunlunXPUAccelerator(Accelerator):
    """Kunlun XPUs (P800 and later) through torch_xmlir, or torch's native XPU support.

    ``dist_backend`` is ``bkcl`` with torch_xmlir and ``xccl`` with native torch.xpu
    (decided when the accelerator is created). Memory-stat functions a runtime lacks
    report 0 instead of failing.
    """

    name: ClassVar[str] = "xpu"
    device_type: ClassVar[str] = "xpu"
    dist_backend: str = "bkcl"  # type: ignore[misc]  # per instance: depends on the runtime
    megatron_adapter_ref: ClassVar[str | None] = (
        "longboat.xpu.megatron_adapter:xpu_megatron_adapter"
    )
    runtime_hint: ClassVar[str] = INSTALL_HINT

    def __init__(self) -> None:
        super().__init__()
        runtime = detect_runtime()
        if runtime is None:
            raise AcceleratorUnavailableError(f"Accelerator 'xpu' needs {INSTALL_HINT}.")
        self.runtime: XPURuntime = runtime
        self.dist_backend = runtime.dist_backend
        self._rt = runtime.module

    @classmethod
    def is_available(cls) -> bool:
        return detect_runtime() is not None

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("xpu", self._rt.current_device() if index is None else index)

    def set_device(self, local_rank: int) -> None:
        self._rt.set_device(local_rank)

    def device_count(self) -> int:
        return int(self._rt.device_count())

    def current_device(self) -> int:
        return int(self._rt.current_device())

    def synchronize(self) -> None:
        self._rt.synchronize()

    def manual_seed(self, seed: int) -> None:
        seed_all = getattr(self._rt, "manual_seed_all", None) or self._rt.manual_seed
        seed_all(seed)

    def get_rng_state(self) -> torch.Tensor:
        return self._rt.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._rt.set_rng_state(state)

    def _mem(self, fn: str) -> float:
        getter = getattr(self._rt, fn, None)
        return float(getter()) / _GB if getter is not None else 0.0

    def memory_stats(self) -> dict[str, float]:
        return {
            "allocated_gb": self._mem("memory_allocated"),
            "reserved_gb": self._mem("memory_reserved"),
            "peak_allocated_gb": self._mem("max_memory_allocated"),
        }

    def memory_capacity(self) -> tuple[int, int] | None:
        info = getattr(self._rt, "mem_get_info", None)
        if info is None:
            return None  # a runtime without it: train.memory_budget needs a number
        free, total = info()
        return int(free), int(total)

    def reset_peak_memory_stats(self) -> None:
        reset = getattr(self._rt, "reset_peak_memory_stats", None)
        if reset is not None:
            reset()

    def empty_cache(self) -> None:
        empty = getattr(self._rt, "empty_cache", None)
        if empty is not None:
            empty()

    def stream(self) -> Any:
        return self._rt.Stream()

    def current_stream(self) -> Any:
        return self._rt.current_stream()

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with self._rt.stream(stream):
            yield

    def event(self, enable_timing: bool = False) -> Any:
        return self._rt.Event(enable_timing=enable_timing)

    @property
    def supports_bf16(self) -> bool:
        probe = getattr(self._rt, "is_bf16_supported", None)
        return bool(probe()) if probe is not None else True  # P800 computes in bf16

    @property
    def supports_fp8(self) -> bool:
        return False  # no FP8 path through torch on Kunlun yet
