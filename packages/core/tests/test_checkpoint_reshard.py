"""Save FSDP2-sharded model + AdamW at world size 2 (gloo), load at world size 1: values equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from longboat.core.checkpoint import CheckpointManager, read_manifest
from longboat.core.config.schema import CheckpointConfig
from longboat.core.data.sampler import StatefulDistributedSampler
from longboat.core.distributed import run_multiprocess


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 6))


def _full(state_dict: dict) -> dict:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
        for k, v in state_dict.items()
    }


def _save_at_world_2(rank: int, world: int, ckpt_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = StatefulDistributedSampler(64, seed=5)  # rank/world from the process group
    it = iter(sampler)
    mgr = CheckpointManager(CheckpointConfig(dir=ckpt_dir, keep_last=0))
    refs = {}
    for step in (1, 2):
        idx = [next(it) for _ in range(4)]
        torch.manual_seed(100 * step + rank)
        model(torch.randn(len(idx), 8)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        state = {"model": model, "optim": optim, "sampler": sampler, "rank_note": f"r{rank}"}
        # step 1 synchronous, step 2 async (background gloo group), then close()
        mgr.save(step, state, async_save=(step == 2))
        exp_avg = {
            i: _full({"m": s["exp_avg"], "v": s["exp_avg_sq"]})
            for i, s in enumerate(optim.state[p] for p in model.parameters())
        }
        refs[step] = {"model": _full(model.state_dict()), "moments": exp_avg}
    mgr.close()
    assert model[0].weight.to_local().shape == (16, 8)  # really sharded: half the rows here
    return refs


@pytest.mark.multiprocess
def test_save_world_2_fsdp_load_world_1(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    refs = run_multiprocess(_save_at_world_2, 2, str(ckpt), timeout=90)[0]

    mgr = CheckpointManager(CheckpointConfig(dir=str(ckpt)))
    for step in (1, 2):
        path = ckpt / f"step_{step:08d}"
        manifest = read_manifest(path)
        assert manifest.world_size == 2
        assert {"__0_0.distcp", "__1_0.distcp", "extra_rank0.pt", "extra_rank1.pt"} <= set(
            manifest.files
        )
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sampler = StatefulDistributedSampler(64, num_replicas=1, rank=0, seed=5)
        state = {"model": model, "optim": optim, "sampler": sampler, "rank_note": ""}
        assert mgr.load(state, path) == step
        for k, v in refs[step]["model"].items():
            assert torch.equal(model.state_dict()[k], v), (step, k)
        for i, p in enumerate(model.parameters()):
            assert torch.equal(optim.state[p]["exp_avg"], refs[step]["moments"][i]["m"])
            assert torch.equal(optim.state[p]["exp_avg_sq"], refs[step]["moments"][i]["v"])
        # the global data position carries over: 2 ranks x 4 samples x step
        assert sampler.state_dict()["position"] == 8 * step
        assert state["rank_note"] == "r0"


def _load_at_world_2(rank: int, world: int, path: str) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from longboat.core.checkpoint import CheckpointWarning

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 6))  # other init
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = StatefulDistributedSampler(64, seed=5)
    state = {"model": model, "optim": optim, "sampler": sampler, "rank_note": ""}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = CheckpointManager(CheckpointConfig(dir=str(Path(path).parent))).load(state, path)
    borrowed = any(issubclass(w.category, CheckpointWarning) for w in caught)
    moments = {i: _full({"m": optim.state[p]["exp_avg"]}) for i, p in enumerate(model.parameters())}
    first = next(iter(sampler))
    return {
        "step": step,
        "model": _full(model.state_dict()),
        "moments": moments,
        "borrowed_rank0_extras": borrowed,
        "first_index": first,
    }


@pytest.mark.multiprocess
def test_save_world_1_load_world_2_fsdp(tmp_path: Path) -> None:
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).pow(2).mean().backward()
    optim.step()
    sampler = StatefulDistributedSampler(64, num_replicas=1, rank=0, seed=5)
    it = iter(sampler)
    consumed = [next(it) for _ in range(10)]
    mgr = CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    path = mgr.save(1, {"model": model, "optim": optim, "sampler": sampler, "rank_note": "r0"})

    out = run_multiprocess(_load_at_world_2, 2, str(path), timeout=90)
    for rank, got in enumerate(out):
        assert got["step"] == 1
        for k, v in model.state_dict().items():
            assert torch.equal(got["model"][k], v), (rank, k)
        for i, p in enumerate(model.parameters()):
            assert torch.equal(got["moments"][i]["m"], optim.state[p]["exp_avg"])
        assert got["borrowed_rank0_extras"] == (rank == 1)
    # both ranks continue the global order right after the 10 consumed samples
    assert [got["first_index"] for got in out] == [next(it), next(it)]
    assert not {got["first_index"] for got in out} & set(consumed)
