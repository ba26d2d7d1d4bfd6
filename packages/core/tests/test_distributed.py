"""Distributed init, parallel resolution, DeviceMesh and the multiprocess launcher (gloo, CPU)."""

from __future__ import annotations

import os
import pickle
import sys

import pytest
import torch
import torch.distributed as dist

from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import ParallelConfig
from longboat.core.distributed import (
    MultiprocessError,
    build_device_mesh,
    destroy_distributed,
    dp_mesh,
    find_free_port,
    init_distributed,
    mesh_shape,
    resolve_parallel,
    run_multiprocess,
)

# ---------------------------------------------------------------- workers (module level)


def _all_reduce_worker(rank: int, world_size: int, scale: float) -> dict:
    info = init_distributed()  # reuses the group run_multiprocess created
    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    return {
        "rank": info.rank,
        "world": info.world_size,
        "backend": info.backend,
        "sum": t.item(),
        "env_rank": int(os.environ["RANK"]),
        "accelerator": os.environ["LONGBOAT_ACCELERATOR"],
    }


def _mesh_worker(rank: int, world_size: int, parallel: ParallelConfig) -> dict:
    mesh = build_device_mesh(parallel, world_size, "cpu")
    out = {
        "names": mesh.mesh_dim_names,
        "shape": tuple(mesh.shape),
        "sizes": {n: mesh[n].size() for n in mesh.mesh_dim_names},
    }
    dp = dp_mesh(mesh)
    out["dp_size"] = dp.size()
    # Reduce over dp only: the sum of global ranks in my dp group is checkable on the host.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=dp.get_group())
    out["dp_sum"] = t.item()
    out["dp_ranks"] = sorted(dist.get_process_group_ranks(dp.get_group()))
    return out


def _env_init_worker(rank: int, world_size: int, port: int) -> tuple:
    # Start from what torchrun gives a process: env vars and no process group.
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    info = init_distributed()
    t = torch.tensor([10.0**rank])
    dist.all_reduce(t)
    destroy_distributed()
    destroy_distributed()  # idempotent
    return (
        info.rank,
        info.local_rank,
        info.world_size,
        info.backend,
        t.item(),
        dist.is_initialized(),
    )


def _failing_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 blocks here until the launcher stops it


def _sleepy_worker(rank: int, world_size: int) -> None:
    import time

    time.sleep(30)


# ---------------------------------------------------------------- resolve_parallel


def test_resolve_infers_dp():
    p = resolve_parallel(ParallelConfig(tensor_parallel=2, pipeline_parallel=2), 8)
    assert p.data_parallel == 2
    assert resolve_parallel(ParallelConfig(), 1).data_parallel == 1
    # the input is not mutated
    orig = ParallelConfig(tensor_parallel=2)
    resolve_parallel(orig, 4)
    assert orig.data_parallel == -1


def test_resolve_world_size_mismatch_names_keys():
    with pytest.raises(ConfigError) as info:
        resolve_parallel(ParallelConfig(tensor_parallel=2, data_parallel=3), 4)
    msg = str(info.value)
    assert "parallel.data_parallel=3" in msg and "world size 4 != tp=2 x pp=1 x cp=1 x dp=3" in msg
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_parallel(ParallelConfig(tensor_parallel=3), 4)


def test_resolve_collects_every_problem():
    bad = ParallelConfig(
        expert_parallel=3, data_parallel_replicate=2, strategy="ddp", tensor_parallel=1
    )
    with pytest.raises(ConfigError) as info:
        resolve_parallel(bad, 4)
    assert set(info.value.keys) == {"parallel.expert_parallel", "parallel.data_parallel_replicate"}
    with pytest.raises(ConfigError, match=r"parallel\.strategy"):
        resolve_parallel(ParallelConfig(strategy="zero3"), 2)
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel"):
        resolve_parallel(ParallelConfig(tensor_parallel=0), 2)
    with pytest.raises(ConfigError, match="virtual_pipeline_parallel"):
        resolve_parallel(ParallelConfig(virtual_pipeline_parallel=2), 2)
    with pytest.raises(ConfigError, match="data_parallel_replicate"):
        resolve_parallel(ParallelConfig(data_parallel_replicate=3, strategy="hsdp"), 4)


def test_mesh_shape_keeps_only_used_dims():
    assert mesh_shape(ParallelConfig(), 4) == (("dp",), (4,))
    assert mesh_shape(ParallelConfig(tensor_parallel=4), 4) == (("dp", "tp"), (1, 4))
    assert mesh_shape(
        ParallelConfig(tensor_parallel=2, pipeline_parallel=2, context_parallel=2), 16
    ) == (("pp", "dp", "cp", "tp"), (2, 2, 2, 2))
    hsdp = ParallelConfig(strategy="hsdp", data_parallel_replicate=2)
    assert mesh_shape(hsdp, 8) == (("dp_replicate", "dp_shard"), (2, 4))


def test_init_distributed_single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    info = init_distributed()
    assert (info.rank, info.local_rank, info.world_size, info.backend) == (0, 0, 1, "")
    assert info.is_main and not dist.is_initialized()


def test_init_distributed_missing_master(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        init_distributed()


# ---------------------------------------------------------------- multiprocess


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sums(world_size):
    out = run_multiprocess(_all_reduce_worker, world_size, 0.5)
    expected = 0.5 * world_size * (world_size + 1) / 2
    assert [o["rank"] for o in out] == list(range(world_size))
    assert [o["env_rank"] for o in out] == list(range(world_size))
    for o in out:
        assert o["world"] == world_size and o["backend"] == "gloo"
        assert o["sum"] == pytest.approx(expected, abs=0)
        assert o["accelerator"] == "cpu"


@pytest.mark.multiprocess
def test_init_distributed_from_torchrun_env():
    out = run_multiprocess(_env_init_worker, 2, find_free_port())
    assert out == [(0, 0, 2, "gloo", 11.0, False), (1, 1, 2, "gloo", 11.0, False)]


@pytest.mark.multiprocess
def test_mesh_tp_dp_world4():
    out = run_multiprocess(_mesh_worker, 4, ParallelConfig(tensor_parallel=2))
    for rank, o in enumerate(out):
        assert o["names"] == ("dp", "tp") and o["shape"] == (2, 2)
        assert o["sizes"] == {"dp": 2, "tp": 2} and o["dp_size"] == 2
        # row-major mesh [[0, 1], [2, 3]]: dp groups are the columns {0, 2} and {1, 3}
        assert o["dp_ranks"] == [rank % 2, rank % 2 + 2]
        assert o["dp_sum"] == float(2 * (rank % 2) + 2)


@pytest.mark.multiprocess
def test_mesh_hsdp_world4():
    out = run_multiprocess(
        _mesh_worker, 4, ParallelConfig(strategy="hsdp", data_parallel_replicate=2)
    )
    for o in out:
        assert o["names"] == ("dp_replicate", "dp_shard") and o["shape"] == (2, 2)
        assert o["dp_size"] == 4 and o["dp_ranks"] == [0, 1, 2, 3]
        assert o["dp_sum"] == 6.0


@pytest.mark.multiprocess
def test_worker_error_surfaces_traceback():
    with pytest.raises(MultiprocessError) as info:
        run_multiprocess(_failing_worker, 2, timeout=60)
    msg = str(info.value)
    assert "rank 1 of 2" in msg
    assert "boom from rank one" in msg and "_failing_worker" in msg  # the child's traceback


@pytest.mark.multiprocess
def test_timeout_names_pending_ranks():
    with pytest.raises(
        MultiprocessError, match=r"timed out after 2s; ranks still running: \[0, 1\]"
    ):
        run_multiprocess(_sleepy_worker, 2, timeout=2)


def test_function_ref_reimports_test_module_by_path():
    # What a spawned child does: the test module is not importable by name under
    # importlib mode, so the function is re-imported from its source file.
    from longboat.core.distributed.multiprocess import _FunctionRef

    ref = pickle.loads(pickle.dumps(_FunctionRef(_all_reduce_worker)))
    ref.module = "longboat_test_reimported_module"  # a name no importer knows
    try:
        fn = ref.resolve()
        assert fn is not _all_reduce_worker and fn.__code__.co_filename == __file__
    finally:
        sys.modules.pop("longboat_test_reimported_module", None)
    with pytest.raises(ValueError, match="module-level"):
        _FunctionRef(lambda rank, world: None)


@pytest.mark.slow  # each spawned rank re-imports torch: ~10-25 s on 2 busy cores
@pytest.mark.multiprocess
def test_spawn_reimports_test_module_by_path():
    out = run_multiprocess(_all_reduce_worker, 2, 1.0, start_method="spawn", timeout=90)
    assert [o["sum"] for o in out] == [3.0, 3.0]


def test_run_multiprocess_refuses_to_fork_a_live_process_group(tmp_path) -> None:
    """Forking while this process holds a process group would hang the workers: refuse."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="destroy_distributed"):
            run_multiprocess(_all_reduce_worker, 2, 1.0)
    finally:
        dist.destroy_process_group()
