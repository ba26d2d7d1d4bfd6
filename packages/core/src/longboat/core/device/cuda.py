"""NVIDIA GPUs through ``torch.cuda`` (the only module in longboat that calls it)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from longboat.core.device.base import Accelerator

_GB = float(1 << 30)


class CUDAAccelerator(Accelerator):
    """CUDA (and ROCm, which torch exposes as ``cuda``) devices with NCCL collectives."""

    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"
    megatron_adapter_ref: ClassVar[str | None] = None  # megatron-core targets CUDA natively
    runtime_hint: ClassVar[str] = (
        "a CUDA build of torch and a visible NVIDIA GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
    )

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @classmethod
    def rng_reseed_functions(cls) -> list[tuple[Any, str]]:
        return [(torch.cuda, name) for name in ("manual_seed", "manual_seed_all", "set_rng_state")]

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state)

    @contextmanager
    def fork_rng(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()], device_type="cuda"):
            yield

    def memory_stats(self) -> dict[str, float]:
        return {
            "allocated_gb": torch.cuda.memory_allocated() / _GB,
            "reserved_gb": torch.cuda.memory_reserved() / _GB,
            "peak_allocated_gb": torch.cuda.max_memory_allocated() / _GB,
        }

    def memory_capacity(self) -> tuple[int, int] | None:
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def stream(self) -> Any:
        return torch.cuda.Stream()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def event(self, enable_timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=enable_timing)

    def graph_backend(self) -> Any:
        """CUDA graphs for ``longboat.core.loop.GraphedStep``."""
        return CUDAGraphBackend()

    @property
    def supports_bf16(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    @property
    def supports_fp8(self) -> bool:
        # FP8 tensor cores arrived with Ada (8.9) and Hopper (9.0).
        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)

    def device_name(self) -> str:
        """``<GPU name> (compute capability <major>.<minor>)``."""
        if not torch.cuda.is_available():
            return "cuda (no device visible)"
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (compute capability {major}.{minor})"


class CUDAGraphBackend:
    """Side streams, a host-sync finder and graph capture: what ``loop.GraphedStep`` needs."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def run_on_side_stream(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` eagerly on a side stream."""
        return self._side(fn, find_syncs=False)

    def run_and_find_syncs(self, fn: Callable[[], Any]) -> tuple[Any, list[str]]:
        """``run_on_side_stream`` that also returns where ``fn`` synchronised with the host
        (``torch.cuda.set_sync_debug_mode("warn")`` warnings: file:line and message)."""
        return self._side(fn, find_syncs=True)

    def _side(self, fn: Callable[[], Any], find_syncs: bool) -> Any:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        syncs: list[str] = []
        with torch.cuda.stream(side):
            if not find_syncs:
                out = fn()
            else:
                previous = torch.cuda.get_sync_debug_mode()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        out = fn()
                    finally:
                        torch.cuda.set_sync_debug_mode(previous)
                syncs = [
                    f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}"
                    for w in caught
                    if "synchroniz" in str(w.message) and "prototype" not in str(w.message)
                ]
        torch.cuda.current_stream().wait_stream(side)
        return (out, syncs) if find_syncs else out

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls from other threads (a DataLoader's pin-memory thread
        # allocating pinned host memory) must not invalidate this thread's capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out
