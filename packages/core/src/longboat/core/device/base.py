"""The accelerator interface every device backend implements.

Code outside ``longboat.core.device`` talks to the device only through an
``Accelerator`` (``get_accelerator()``), never through ``torch.cuda`` directly,
so a plugin (e.g. Kunlun XPU) can run every stack unchanged.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch


class AcceleratorUnavailableError(RuntimeError):
    """A registered accelerator was selected but its runtime is missing on this machine."""


class Accelerator(ABC):
    """One device backend: placement, RNG, memory, streams and capabilities.

    Subclasses set the class attributes and implement the abstract methods.
    Stream/event methods have no-op defaults so host-only backends need not
    override them.
    """

    name: ClassVar[str]
    """Registry name (``cpu``, ``cuda``, ``xpu``)."""
    device_type: ClassVar[str]
    """``torch.device`` type string."""
    dist_backend: ClassVar[str]
    """torch.distributed backend for this device (``gloo``, ``nccl``, ...)."""
    megatron_adapter_ref: ClassVar[str | None] = None
    """``"module:attr"`` of the megatron-core adapter; None when megatron works natively."""
    runtime_hint: ClassVar[str] = ""
    """What to install when ``is_available()`` is False (shown in the error)."""

    def __init__(self) -> None:
        self._megatron_adapter: Any = None
        self._megatron_adapter_resolved = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device_type={self.device_type!r})"

    # --- availability and placement -------------------------------------------------
    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """True when this backend's runtime and at least one device are present."""

    @abstractmethod
    def device(self, index: int | None = None) -> torch.device:
        """The ``torch.device`` for ``index`` (the current device when None)."""

    @abstractmethod
    def set_device(self, local_rank: int) -> None:
        """Make ``local_rank``'s device current for this process."""

    @abstractmethod
    def device_count(self) -> int:
        """Number of visible devices."""

    @abstractmethod
    def current_device(self) -> int:
        """Index of the current device."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued work on the current device."""

    # --- RNG ----------------------------------------------------------------------------
    @abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the device RNG of every visible device."""

    @abstractmethod
    def get_rng_state(self) -> torch.Tensor:
        """The current device's RNG state (a CPU ByteTensor)."""

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a state returned by ``get_rng_state``."""

    @contextmanager
    def fork_rng(self) -> Iterator[None]:
        """Run a block with forked CPU and device RNGs, restoring both afterwards."""
        cpu_state = torch.get_rng_state()
        device_state = self.get_rng_state()
        try:
            yield
        finally:
            torch.set_rng_state(cpu_state)
            self.set_rng_state(device_state)

    # --- memory ---------------------------------------------------------------------------
    @abstractmethod
    def memory_stats(self) -> dict[str, float]:
        """``allocated_gb``, ``reserved_gb``, ``peak_allocated_gb`` of the current device."""

    def memory_capacity(self) -> tuple[int, int] | None:
        """(free, total) bytes of the current device's memory, or None where the device has
        no memory of its own to plan for (the host-only default)."""
        return None

    def reset_peak_memory_stats(self) -> None:
        """Restart the peak counter of ``memory_stats()``."""
        return None  # host-only default: nothing to reset

    def empty_cache(self) -> None:
        """Release cached, unused device memory."""
        return None  # host-only default: no caching allocator

    # --- streams and events (no-op defaults for host-only backends) ----------------------
    def stream(self) -> Any:
        """A new side stream."""
        return NullStream()

    def current_stream(self) -> Any:
        """The stream work is queued on now."""
        return NullStream()

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        """Queue work of the block on ``stream``."""
        del stream
        yield

    def event(self, enable_timing: bool = False) -> Any:
        """A new event (records a host timestamp on host-only backends)."""
        return HostEvent(enable_timing=enable_timing)

    # --- capabilities ------------------------------------------------------------------------
    @classmethod
    def rng_reseed_functions(cls) -> list[tuple[Any, str]]:
        """``(owner, attribute)`` of this device's functions that reseed or reset its RNG
        generators (what a CUDA-graph-captured step must not call: ``loop.capture_check``
        watches them). None beyond torch's own by default."""
        return []

    def graph_backend(self) -> Any:
        """What ``longboat.core.loop.GraphedStep`` replays a step with (side streams, a
        host-sync finder, graph capture; see ``cuda.CUDAGraphBackend``), or None where the
        device has no graphs (the default): the step then runs eagerly."""
        return None

    @property
    def supports_bf16(self) -> bool:
        """bfloat16 compute is supported (and fast enough to be the default)."""
        return False

    @property
    def supports_fp8(self) -> bool:
        """FP8 matmuls are supported."""
        return False

    def device_name(self) -> str:
        """The device's name for messages and per-device caches (the device type here;
        accelerators with models override it)."""
        return self.device_type

    # --- megatron -----------------------------------------------------------------------------
    def megatron_adapter(self) -> Any:
        """The megatron-core adapter object, imported on first use; None if not needed.

        The adapter lives outside ``longboat.core.device`` (``megatron_adapter_ref``),
        so importing the device layer never imports megatron. The ref names either a
        class or a factory function; it is called with this accelerator.
        """
        if not self._megatron_adapter_resolved:
            self._megatron_adapter = _resolve_ref(self.megatron_adapter_ref, accelerator=self)
            self._megatron_adapter_resolved = True
        return self._megatron_adapter


def _resolve_ref(ref: str | None, *, accelerator: Accelerator) -> Any:
    """Import ``"module:attr"`` and call it (a class or factory) with ``accelerator``."""
    if ref is None:
        return None
    owner = accelerator.name
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"Accelerator {owner!r}: megatron_adapter_ref={ref!r} is not 'module:attr'. "
            "Fix: set it to e.g. 'longboat.core.megatron.adapters:CPUMegatronAdapter'."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"Accelerator {owner!r}: cannot import megatron adapter module {module_name!r} "
            f"({exc}). Fix: install longboat-core[megatron] (and the accelerator's plugin)."
        ) from exc
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        raise ImportError(
            f"Accelerator {owner!r}: module {module_name!r} has no attribute {attr!r} "
            f"(megatron_adapter_ref={ref!r})."
        ) from exc
    return obj(accelerator) if callable(obj) else obj


class NullStream:
    """Stream stand-in for host-only backends: everything is already synchronous."""

    def synchronize(self) -> None:
        """Nothing queued: returns at once."""

    def wait_stream(self, stream: Any) -> None:
        """Host work is ordered already."""
        del stream

    def wait_event(self, event: Any) -> None:
        """Host work is ordered already."""
        del event

    def record_event(self, event: Any = None) -> HostEvent:
        """Record (and return) an event at the current host time."""
        event = event if event is not None else HostEvent(enable_timing=True)
        event.record()
        return event

    def query(self) -> bool:
        """Always complete."""
        return True


class HostEvent:
    """Event stand-in that records ``time.perf_counter`` so ``elapsed_time`` still works."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        """Mark the current host time."""
        del stream
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""
        del stream

    def query(self) -> bool:
        """Always complete."""
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end`` (both must be recorded)."""
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs both events to be recorded first")
        return (end._t - self._t) * 1000.0
