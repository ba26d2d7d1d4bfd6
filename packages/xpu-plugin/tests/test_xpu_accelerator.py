"""Kunlun XPU plugin: entry-point registration, env selection, the missing-runtime message,
and the accelerator driven through a fake runtime module."""

from __future__ import annotations

import sys
import types
from importlib.metadata import entry_points

import pytest
import torch

from longboat.core.device import (
    AcceleratorUnavailableError,
    available_accelerators,
    get_accelerator,
    registered_accelerators,
)
from longboat.core.device.registry import _reset_for_tests
from longboat.xpu import runtime as xpu_runtime
from longboat.xpu.accelerator import KunlunXPUAccelerator


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("LONGBOAT_ACCELERATOR", raising=False)
    _reset_for_tests()
    xpu_runtime.detect_runtime.cache_clear()
    yield
    _reset_for_tests()
    xpu_runtime.detect_runtime.cache_clear()


def _no_real_runtime() -> bool:
    return xpu_runtime.detect_runtime() is None


class FakeDeviceModule:
    """torch.cuda-like API backed by the CPU, standing in for torch_xmlir's device module."""

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.current = 0
        self.allocated = 3 << 30
        self.seeds: list[int] = []
        self.peak_resets = 0
        self.calls: list[str] = []  # no-result calls, to check they reach the runtime
        self.entered_streams: list[object] = []

    def device_count(self) -> int:
        return self.count

    def is_available(self) -> bool:
        return self.count > 0

    def set_device(self, i: int) -> None:
        self.current = i

    def current_device(self) -> int:
        return self.current

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def manual_seed_all(self, seed: int) -> None:
        self.seeds.append(seed)
        torch.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def memory_allocated(self) -> int:
        return self.allocated

    def memory_reserved(self) -> int:
        return 4 << 30

    def max_memory_allocated(self) -> int:
        return 5 << 30

    def reset_peak_memory_stats(self) -> None:
        self.peak_resets += 1

    class Stream:
        pass

    def current_stream(self) -> Stream:
        return self.Stream()

    def stream(self, s):
        import contextlib

        self.entered_streams.append(s)
        return contextlib.nullcontext(s)

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.enable_timing = enable_timing


@pytest.fixture
def fake_xmlir(monkeypatch) -> FakeDeviceModule:
    """A fake ``torch_xmlir`` package exposing the device module as ``torch_xmlir.xpu``."""
    device_module = FakeDeviceModule()
    pkg = types.ModuleType("torch_xmlir")
    pkg.xpu = device_module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_xmlir", pkg)
    return device_module


def test_entry_point_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="longboat.accelerators")}
    assert eps["xpu"] == "longboat.xpu.accelerator:KunlunXPUAccelerator"
    assert "xpu" in registered_accelerators()


@pytest.mark.skipif(not _no_real_runtime(), reason="a real XPU runtime is present")
def test_env_selection_without_runtime_names_what_to_install(monkeypatch):
    assert "xpu" not in available_accelerators()
    assert not KunlunXPUAccelerator.is_available()
    monkeypatch.setenv("LONGBOAT_ACCELERATOR", "xpu")
    with pytest.raises(AcceleratorUnavailableError) as info:
        get_accelerator()
    msg = str(info.value)
    assert "'xpu'" in msg and "$LONGBOAT_ACCELERATOR" in msg
    assert "torch_xmlir" in msg and "Kunlun" in msg and "xpu-smi" in msg
    assert "Available here: cpu" in msg
    with pytest.raises(AcceleratorUnavailableError, match="torch_xmlir"):
        get_accelerator("xpu")
    with pytest.raises(AcceleratorUnavailableError, match="torch_xmlir"):
        KunlunXPUAccelerator()


def test_env_selects_xpu_with_torch_xmlir(monkeypatch, fake_xmlir):
    monkeypatch.setenv("LONGBOAT_ACCELERATOR", "xpu")
    acc = get_accelerator()
    assert isinstance(acc, KunlunXPUAccelerator)
    assert acc.runtime.kind == "torch_xmlir" and acc.runtime.module is fake_xmlir
    assert (acc.name, acc.device_type, acc.dist_backend) == ("xpu", "xpu", "bkcl")
    assert "xpu" in available_accelerators()


def test_native_torch_xpu_uses_xccl(monkeypatch):
    native = FakeDeviceModule(count=1)
    monkeypatch.setattr(torch, "xpu", native, raising=False)
    monkeypatch.delitem(sys.modules, "torch_xmlir", raising=False)
    acc = get_accelerator("xpu")
    assert acc.runtime.kind == "native" and acc.dist_backend == "xccl"


def test_interface_delegates_to_runtime(fake_xmlir):
    acc = get_accelerator("xpu")
    acc.set_device(1)
    assert acc.current_device() == 1 and acc.device() == torch.device("xpu", 1)
    assert acc.device(0) == torch.device("xpu", 0) and acc.device_count() == 2
    acc.manual_seed(11)
    assert fake_xmlir.seeds == [11]
    state = acc.get_rng_state()
    a = torch.rand(3)
    acc.set_rng_state(state)
    torch.testing.assert_close(torch.rand(3), a, rtol=0, atol=0)
    assert acc.memory_stats() == {"allocated_gb": 3.0, "reserved_gb": 4.0, "peak_allocated_gb": 5.0}
    acc.reset_peak_memory_stats()
    assert fake_xmlir.peak_resets == 1
    s = acc.stream()
    assert isinstance(s, FakeDeviceModule.Stream)
    with acc.use_stream(s):
        assert fake_xmlir.entered_streams == [s]
    assert isinstance(acc.current_stream(), FakeDeviceModule.Stream)
    acc.synchronize()
    acc.empty_cache()
    assert fake_xmlir.calls == ["synchronize", "empty_cache"]
    assert acc.event(enable_timing=True).enable_timing
    assert acc.supports_bf16 and not acc.supports_fp8


def test_megatron_adapter_is_bound_to_xpu(fake_xmlir):
    # The adapter object is built without importing megatron (that happens at install()).
    adapters = pytest.importorskip("longboat.core.megatron.adapters")
    AcceleratorMegatronAdapter = adapters.AcceleratorMegatronAdapter

    acc = get_accelerator("xpu")
    adapter = acc.megatron_adapter()
    assert isinstance(adapter, AcceleratorMegatronAdapter)
    assert adapter.accelerator is acc and adapter.name == "xpu" and not adapter.installed


def test_runtime_without_devices_is_unavailable(monkeypatch, fake_xmlir):
    fake_xmlir.count = 0
    with pytest.raises(AcceleratorUnavailableError, match="torch_xmlir"):
        get_accelerator("xpu")
