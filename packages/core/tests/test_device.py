"""Accelerator interface, CPU built-in and registry selection."""

from __future__ import annotations

import time

import pytest
import torch

from longboat.core import device as dev
from longboat.core.device import (
    Accelerator,
    AcceleratorUnavailableError,
    CPUAccelerator,
    CUDAAccelerator,
    UnknownAcceleratorError,
    get_accelerator,
    register_accelerator,
)
from longboat.core.device.registry import _reset_for_tests


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    monkeypatch.delenv("LONGBOAT_ACCELERATOR", raising=False)
    _reset_for_tests()
    yield
    _reset_for_tests()


class _FakeAdapter:
    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator


class _MissingRuntimeAccelerator(CPUAccelerator):
    name = "fakegpu"
    device_type = "cpu"
    runtime_hint = "the FakeGPU runtime (pip install fakegpu-runtime)"

    @classmethod
    def is_available(cls) -> bool:
        return False


class _AvailableAccelerator(CPUAccelerator):
    name = "fakeavail"
    megatron_adapter_ref = f"{__name__}:_FakeAdapter"


def test_auto_picks_cpu_without_gpu():
    acc = get_accelerator()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert acc.name == expected
    assert get_accelerator() is acc  # one shared instance per name


def test_env_forces_accelerator(monkeypatch):
    monkeypatch.setenv("LONGBOAT_ACCELERATOR", "cpu")
    assert isinstance(get_accelerator(), CPUAccelerator)
    monkeypatch.setenv("LONGBOAT_ACCELERATOR", "auto")
    assert get_accelerator().name in ("cpu", "cuda")


def test_unknown_name_lists_known_ones(monkeypatch):
    monkeypatch.setenv("LONGBOAT_ACCELERATOR", "cdua")
    with pytest.raises(UnknownAcceleratorError) as info:
        get_accelerator()
    msg = str(info.value)
    assert "'cdua'" in msg and "LONGBOAT_ACCELERATOR" in msg
    assert "cpu" in msg and "cuda" in msg
    assert "Did you mean 'cuda'" in msg


def test_registered_but_unavailable_names_runtime():
    register_accelerator("fakegpu", _MissingRuntimeAccelerator)
    assert "fakegpu" in dev.registered_accelerators()
    assert "fakegpu" not in dev.available_accelerators()
    with pytest.raises(AcceleratorUnavailableError, match=r"fakegpu-runtime"):
        get_accelerator("fakegpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_unavailable_message():
    with pytest.raises(AcceleratorUnavailableError, match="NVIDIA GPU"):
        get_accelerator("cuda")
    assert not CUDAAccelerator.is_available()


def test_register_rejects_duplicates_and_non_accelerators():
    with pytest.raises(ValueError, match="already registered"):
        register_accelerator("cpu", _AvailableAccelerator)
    with pytest.raises(TypeError):
        register_accelerator("bad", object)  # type: ignore[arg-type]


def test_megatron_adapter_resolved_lazily():
    register_accelerator("fakeavail", _AvailableAccelerator)
    acc = get_accelerator("fakeavail")
    adapter = acc.megatron_adapter()
    assert isinstance(adapter, _FakeAdapter) and adapter.accelerator is acc
    assert acc.megatron_adapter() is adapter  # resolved once
    assert CUDAAccelerator.megatron_adapter_ref is None
    assert CPUAccelerator.megatron_adapter_ref == (
        "longboat.core.megatron.adapters:CPUMegatronAdapter"
    )


def test_cuda_adapter_is_none_without_import():
    assert CUDAAccelerator().megatron_adapter() is None


def test_bad_adapter_ref_errors():
    class Bad(CPUAccelerator):
        megatron_adapter_ref = "no_colon_here"

    with pytest.raises(ValueError, match="module:attr"):
        Bad().megatron_adapter()

    class Missing(CPUAccelerator):
        megatron_adapter_ref = "longboat_nonexistent_mod:X"

    with pytest.raises(ImportError, match="longboat_nonexistent_mod"):
        Missing().megatron_adapter()


def test_cpu_interface():
    acc = get_accelerator("cpu")
    assert isinstance(acc, Accelerator)
    assert acc.device() == torch.device("cpu") and acc.device(3) == torch.device("cpu")
    assert (acc.device_type, acc.dist_backend) == ("cpu", "gloo")
    acc.set_device(0)
    acc.synchronize()
    acc.empty_cache()
    assert acc.device_count() == 1 and acc.current_device() == 0
    assert acc.supports_bf16 and not acc.supports_fp8


def test_cpu_rng_roundtrip_and_fork():
    acc = get_accelerator("cpu")
    acc.manual_seed(7)
    a = torch.rand(4)
    acc.manual_seed(7)
    state = acc.get_rng_state()
    b = torch.rand(4)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    acc.set_rng_state(state)
    torch.testing.assert_close(torch.rand(4), b, rtol=0, atol=0)
    acc.set_rng_state(state)
    with acc.fork_rng():
        torch.rand(100)
    torch.testing.assert_close(torch.rand(4), b, rtol=0, atol=0)


def test_cpu_memory_stats_track_allocations():
    acc = get_accelerator("cpu")
    acc.reset_peak_memory_stats()
    before = acc.memory_stats()
    assert set(before) == {"allocated_gb", "reserved_gb", "peak_allocated_gb"}
    big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched so it is resident
    after = acc.memory_stats()
    assert after["allocated_gb"] - before["allocated_gb"] > 0.05
    del big  # 64 MiB is above malloc's mmap threshold: freeing returns it to the OS
    freed = acc.memory_stats()
    assert after["allocated_gb"] - freed["allocated_gb"] > 0.05
    # The peak remembers the 64 MiB after the free, until a reset.
    assert freed["peak_allocated_gb"] >= after["allocated_gb"]
    acc.reset_peak_memory_stats()
    assert acc.memory_stats()["peak_allocated_gb"] < after["allocated_gb"] - 0.05


def test_cpu_streams_and_events_are_noops_with_timing():
    acc = get_accelerator("cpu")
    s = acc.stream()
    with acc.use_stream(s):
        start, end = acc.event(enable_timing=True), acc.event(enable_timing=True)
        start.record()
        time.sleep(0.02)
        end.record()
    end.synchronize()
    acc.current_stream().wait_stream(s)
    assert s.query() and end.query()
    assert end.elapsed_time(end) == 0.0
    assert 20.0 <= start.elapsed_time(end) < 5000.0  # milliseconds, like torch.cuda.Event
    with pytest.raises(RuntimeError, match="recorded"):
        acc.event().elapsed_time(end)


def test_plugin_entry_point_is_loaded(monkeypatch):
    from importlib.metadata import EntryPoint

    ep = EntryPoint(
        name="fakeavail",
        value=f"{__name__}:_AvailableAccelerator",
        group="longboat.accelerators",
    )
    broken = EntryPoint(name="broken", value="nope_mod:Nope", group="longboat.accelerators")

    def fake_entry_points(group: str):
        assert group == "longboat.accelerators"
        return [ep, broken]

    monkeypatch.setattr(dev.registry, "entry_points", fake_entry_points)
    assert "fakeavail" in dev.available_accelerators()
    assert isinstance(get_accelerator("fakeavail"), _AvailableAccelerator)
    with pytest.raises(UnknownAcceleratorError, match="failed to load"):
        get_accelerator("broken")
