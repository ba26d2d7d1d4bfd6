"""CheckpointManager: round trip, manifest, corruption, keep-last-N, async, invalid folders."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from longboat.core.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointWarning,
    InvalidCheckpointError,
    read_manifest,
)
from longboat.core.checkpoint.manifest import file_sha256
from longboat.core.config.schema import CheckpointConfig
from longboat.core.data.sampler import StatefulDistributedSampler
from longboat.core.rng import RNGState


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))


def _trained(seed: int = 0, steps: int = 3) -> dict:
    model = _model(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    sampler = StatefulDistributedSampler(40, num_replicas=1, rank=0, seed=0)
    it = iter(sampler)
    for _ in range(steps):
        idx = [next(it) for _ in range(4)]
        x = torch.randn(len(idx), 6)
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "sampler": sampler,
        "rng": RNGState(),
        "tokens_seen": 123,
        "meta": {"note": "hi", "losses": [1.0, 0.5]},
    }


def _fresh(seed: int = 1) -> dict:
    return _trained(seed=seed, steps=0) | {"tokens_seen": 0, "meta": {}}


def _mgr(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt"), **kw), {"lr": 0.01})


def _assert_model_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_round_trip_restores_every_part_and_writes_a_manifest(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path)
    src = _trained()
    path = mgr.save(3, src)
    assert path.name == "step_00000003" and mgr.latest() == path
    after_save = torch.rand(5)  # the RNG stream right after the save

    dst = _fresh()
    assert mgr.load(dst) == 3
    _assert_model_equal(src["model"], dst["model"])
    so, do = src["optim"].state_dict(), dst["optim"].state_dict()
    for pid, st in so["state"].items():
        for k, v in st.items():
            assert torch.equal(v, do["state"][pid][k]), (pid, k)
    assert so["param_groups"][0]["lr"] == do["param_groups"][0]["lr"] == pytest.approx(0.01 / 4)
    assert dst["sched"].state_dict()["last_epoch"] == 3
    assert dst["sampler"].state_dict() == src["sampler"].state_dict()
    assert dst["tokens_seen"] == 123 and dst["meta"] == {"note": "hi", "losses": [1.0, 0.5]}
    assert torch.equal(torch.rand(5), after_save)

    manifest = read_manifest(path)
    assert manifest.step == 3 and manifest.world_size == 1
    assert manifest.config == {"lr": 0.01}
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert set(manifest.files) == on_disk - {"manifest.json"}
    assert {".metadata", "extra_rank0.pt"} <= set(manifest.files)
    for name, info in manifest.files.items():
        assert info["sha256"] == file_sha256(path / name)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]


def test_load_without_checkpoints_returns_none(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path)
    assert mgr.latest() is None
    assert mgr.load(_fresh()) is None


@pytest.mark.parametrize("victim", ["__0_0.distcp", "extra_rank0.pt"])
def test_flipped_byte_raises_checksum_error_naming_file(tmp_path: Path, victim: str) -> None:
    mgr = _mgr(tmp_path)
    path = mgr.save(1, _trained())
    target = path / victim
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as err:
        mgr.load(_fresh())
    assert victim in str(err.value) and str(path) in str(err.value)
    assert "checksum mismatch" in str(err.value)


def test_keep_last_n_prunes_only_after_success(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path, keep_last=2)
    state = _trained()
    for step in (10, 20, 30, 40):
        mgr.save(step, state)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step_00000030", "step_00000040"]
    keep_all = _mgr(tmp_path / "all", keep_last=0)
    for step in (1, 2, 3, 4):
        keep_all.save(step, state)
    assert [s for s, _ in keep_all.checkpoints()] == [1, 2, 3, 4]


def test_failed_save_prunes_nothing(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path, keep_last=1)
    mgr.save(1, _trained())
    bad = _trained() | {"not_loadable": random.Random(0)}  # weights_only cannot load this
    with pytest.raises(CheckpointError, match="not_loadable"):
        mgr.save(2, bad)
    assert [s for s, _ in mgr.checkpoints(warn=False)] == [1]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_00000001"]  # no temp left


def test_async_save_round_trip_snapshots_state_at_call_time(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path, async_save=True)
    src = _trained()
    expected = {k: v.clone() for k, v in src["model"].state_dict().items()}
    path = mgr.save(5, src)
    with torch.no_grad():  # training goes on while the write runs
        for p in src["model"].parameters():
            p.add_(1.0)
    mgr.save(6, src)  # waits for step 5 first
    mgr.close()
    assert [s for s, _ in mgr.checkpoints()] == [5, 6]
    dst = _fresh()
    assert mgr.load(dst, path) == 5
    for k, v in dst["model"].state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert mgr.load(dst) == 6
    _assert_model_equal(src["model"], dst["model"])


def test_folders_without_a_valid_manifest_are_ignored_with_a_warning(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path)
    good = mgr.save(1, _trained())
    root = tmp_path / "ckpt"
    (root / "step_00000002").mkdir()  # no manifest
    broken = root / "step_00000003"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")
    with pytest.warns(CheckpointWarning) as record:
        assert mgr.latest() == good
    text = " ".join(str(w.message) for w in record)
    assert "step_00000002" in text and "step_00000003" in text
    with pytest.raises(InvalidCheckpointError, match="step_00000002"):
        mgr.load(_fresh(), root / "step_00000002")


def test_resave_same_step_replaces_it(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path)
    state = _trained()
    mgr.save(7, state)
    with torch.no_grad():
        state["model"][0].weight.fill_(2.5)
    mgr.save(7, state)
    dst = _fresh()
    mgr.load(dst)
    assert torch.equal(dst["model"][0].weight, torch.full((16, 6), 2.5))
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_00000007"]


def test_missing_key_is_an_error_unless_not_strict(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path)
    mgr.save(1, _trained())
    dst = _fresh() | {"ema_decay": 0.0}
    with pytest.raises(CheckpointError, match="ema_decay"):
        mgr.load(dst)
    assert mgr.load(dst, strict=False) == 1
    assert dst["ema_decay"] == 0.0


def test_resume_modes(tmp_path: Path) -> None:
    src = _trained()
    _mgr(tmp_path).save(4, src)
    assert _mgr(tmp_path, resume="none").resume(_fresh()) is None
    assert _mgr(tmp_path, resume="auto").resume(_fresh()) == 4
    explicit = str(tmp_path / "ckpt" / "step_00000004")
    assert _mgr(tmp_path, resume=explicit).resume(_fresh()) == 4
    with pytest.raises(CheckpointError, match="step_00000004"):
        _mgr(tmp_path, resume=str(tmp_path / "nope")).resume(_fresh())


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_crafted_metadata_is_not_unpickled(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path)
    path = mgr.save(1, _trained())
    (path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    # re-sign the manifest so only the unpickler stands in the way
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][".metadata"] = {
        "sha256": file_sha256(path / ".metadata"),
        "bytes": (path / ".metadata").stat().st_size,
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"(posix|os)\.system.*refusing to unpickle"):
        mgr.load(_fresh())


def test_step_0_checkpoint_leaves_a_fresh_optimizer_untouched(tmp_path: Path) -> None:
    """Saving before the first step must not start AdamW's step count (bias correction)."""

    def run(save: bool, load: bool) -> list[torch.Tensor]:
        model = _model(0).eval()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mgr = _mgr(tmp_path / f"{save}{load}")
        if save:
            mgr.save(0, {"model": model, "optim": optim})
            assert not optim.state
        if load:
            assert mgr.load({"model": model, "optim": optim}) == 0
            assert not optim.state
        losses = []
        for _ in range(3):
            loss = model(torch.ones(2, 6)).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        return losses

    ref = run(save=False, load=False)
    for got in (run(save=True, load=False), run(save=True, load=True)):
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
