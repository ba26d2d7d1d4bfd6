"""The CPU megatron adapter: reversible, version-checked patches that make megatron-core run on CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from longboat.core.distributed import run_multiprocess

pytest.importorskip("megatron.core", reason="needs longboat-core[megatron]")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core.utils as mutils
    from megatron.core import package_info
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

from longboat.core.device import get_accelerator
from longboat.core.megatron._patching import MegatronPatchError, PatchSet
from longboat.core.megatron.adapters import (
    PATCHED_MODULES,
    CPUMegatronAdapter,
    MegatronAdapter,
)


def test_cpu_accelerator_resolves_the_adapter() -> None:
    adapter = get_accelerator("cpu").megatron_adapter()
    assert isinstance(adapter, CPUMegatronAdapter)
    assert isinstance(adapter, MegatronAdapter)


def test_install_patches_and_uninstall_restores_everything() -> None:
    import importlib

    modules = [importlib.import_module(m) for m in PATCHED_MODULES]
    fork_code = mrandom.CudaRNGStatesTracker.fork.__wrapped__.__code__
    move_code = moe_utils.maybe_move_tensor_to_cpu.__code__
    get_state = mrandom._get_cuda_rng_state
    adapter = CPUMegatronAdapter(get_accelerator("cpu"))
    adapter.install()
    try:
        assert adapter.installed
        assert all(m.torch is not torch for m in modules)
        assert mrandom._get_cuda_rng_state is not get_state
        assert moe_utils.maybe_move_tensor_to_cpu.__code__ is not move_code
        adapter.install()  # idempotent
    finally:
        adapter.uninstall()
    assert not adapter.installed
    assert all(m.torch is torch for m in modules)
    assert mrandom._get_cuda_rng_state is get_state
    assert mrandom.CudaRNGStatesTracker.fork.__wrapped__.__code__ is fork_code
    assert moe_utils.maybe_move_tensor_to_cpu.__code__ is move_code
    assert not hasattr(mrandom, "_longboat_device_rng_is_cpu_rng")


def test_global_memory_buffer_needs_the_adapter_on_cpu() -> None:
    # Control: without the adapter megatron allocates on CUDA and fails here.
    with pytest.raises((RuntimeError, AssertionError)):
        mutils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
    with CPUMegatronAdapter(get_accelerator("cpu")):
        t = mutils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
    assert t.device.type == "cpu" and t.shape == (2, 3)


def test_other_megatron_versions_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(package_info, "MINOR", 20)
    monkeypatch.setattr(package_info, "__version__", "0.20.0")
    with pytest.raises(MegatronPatchError, match=r"megatron-core 0\.20\.0 is installed.*0\.19\.x"):
        CPUMegatronAdapter(get_accelerator("cpu")).install()


def test_a_moved_call_site_fails_naming_the_function() -> None:
    def f(x):
        return x + 1

    patches = PatchSet()
    with pytest.raises(MegatronPatchError, match=r"f: expected call site 'x \* 2' not found"):
        patches.rewrite_code(f, [("x * 2", "x * 3")])
    patches.rewrite_code(f, [("x + 1", "x + 2")])
    assert f(1) == 3
    patches.undo()
    assert f(1) == 2


def _rng_and_clip_worker(rank: int, world: int) -> dict[str, float]:
    from megatron.core.optimizer.clip_grads import (
        clip_grad_by_total_norm_fp32,
        get_grad_norm_fp32,
    )
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=7)
    try:
        tracker = get_cuda_rng_tracker()
        torch.manual_seed(0)
        default_before = torch.get_rng_state()
        with tracker.fork():
            a = torch.randn(4)
        with tracker.fork():
            b = torch.randn(4)
        # The fork leaves the default stream exactly where it was.
        default_unchanged = torch.equal(torch.get_rng_state(), default_before)
        # The tracked stream is seeded deterministically (seed + 2718 + tp_rank).
        g = torch.Generator().manual_seed(7 + 2718)
        expect = torch.randn(8, generator=g)
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), 3.0)
        norm = get_grad_norm_fp32([p.grad])
        clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=norm)
        return {
            "default_unchanged": float(default_unchanged),
            "tracked_matches": float(torch.equal(torch.cat([a, b]), expect)),
            "norm": float(norm),
            "clipped_norm": float(p.grad.norm()),
        }
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_rng_tracker_and_grad_clipping_on_cpu() -> None:
    (out,) = run_multiprocess(_rng_and_clip_worker, 1)
    assert out["default_unchanged"] == 1.0
    assert out["tracked_matches"] == 1.0
    assert out["norm"] == pytest.approx(6.0, rel=1e-6)  # ||[3, 3, 3, 3]||
    assert out["clipped_norm"] == pytest.approx(1.0, rel=1e-5)


class _MetaAccelerator:
    """A stand-in plugin accelerator: device type 'xpu', tensors on torch's meta device."""

    name = "fake-xpu"
    device_type = "xpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("meta")

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)


def test_general_adapter_routes_to_any_accelerator() -> None:
    from megatron.core.optimizer import optimizer as moptimizer

    from longboat.core.megatron.adapters import AcceleratorMegatronAdapter

    init = moptimizer.Float16OptimizerWithFloat16Params.__init__
    with AcceleratorMegatronAdapter(_MetaAccelerator()):
        t = mutils.GlobalMemoryBuffer().get_tensor((4,), torch.float32, "y")
        assert t.device.type == "meta"
        assert mutils.torch.cuda.current_device() == torch.device("meta")
        assert "torch.xpu.FloatTensor" in init.__code__.co_consts
    assert "torch.cuda.FloatTensor" in init.__code__.co_consts
    with pytest.raises(ValueError, match="CPUMegatronAdapter got a 'xpu' accelerator"):
        CPUMegatronAdapter(_MetaAccelerator())
