"""The host CPU as an accelerator (always available; gloo collectives)."""

from __future__ import annotations

import os
import resource
import sys
from typing import ClassVar

import torch

from longboat.core.device.base import Accelerator

_GB = float(1 << 30)


def _rss_bytes() -> int:
    """Resident set size of this process (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _max_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux and bytes on macOS.
    return peak if sys.platform == "darwin" else peak * 1024


class CPUAccelerator(Accelerator):
    """Host CPU: memory stats report process RSS; streams and events are no-ops."""

    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    megatron_adapter_ref: ClassVar[str | None] = (
        "longboat.core.megatron.adapters:CPUMegatronAdapter"
    )

    def __init__(self) -> None:
        super().__init__()
        # ru_maxrss cannot be reset, so the peak is tracked from our own samples after a reset.
        self._peak_reset = False
        self._peak_since_reset = 0

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, index: int | None = None) -> torch.device:
        del index
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        del local_rank

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def synchronize(self) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.random.default_generator.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def memory_stats(self) -> dict[str, float]:
        rss = _rss_bytes()
        if self._peak_reset:
            self._peak_since_reset = max(self._peak_since_reset, rss)
            peak = self._peak_since_reset
        else:
            peak = max(_max_rss_bytes(), rss)
        return {
            "allocated_gb": rss / _GB,
            "reserved_gb": rss / _GB,
            "peak_allocated_gb": peak / _GB,
        }

    def reset_peak_memory_stats(self) -> None:
        self._peak_reset = True
        self._peak_since_reset = _rss_bytes()

    @property
    def supports_bf16(self) -> bool:
        return True
