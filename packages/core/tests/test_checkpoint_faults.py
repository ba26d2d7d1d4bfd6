"""Checkpoint faults a user can meet: a full disk mid-save, a crafted per-rank state file.

Each must end as one ``CheckpointError`` line (exit 2, no traceback) naming the files, and
leave the previous checkpoint loadable.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from longboat.core.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
)
from longboat.core.checkpoint import manager as manager_module
from longboat.core.checkpoint.manifest import build_manifest, read_manifest, write_manifest
from longboat.core.cli import _dispatch
from longboat.core.config.schema import CheckpointConfig


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(8, 4)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "n": seed}


def _mgr(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt"), keep_last=0))


def _no_space(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullDiskWriter(FileSystemWriter):
    """DCP's writer on a disk that fills up while the shards are written."""

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        _no_space()


def _assert_full_disk_error(exc: CheckpointError, tmp_path: Path, previous: Path) -> None:
    text = str(exc)
    assert "\n" not in text
    assert str(tmp_path / "ckpt" / "step_00000002") in text
    assert "no space left" in text and "needed" in text and "free" in text
    assert f"the previous checkpoint {previous} is intact" in text
    assert exc.exit_code == 2


@pytest.mark.parametrize("where", ["per-rank state", "shards"])
def test_full_disk_mid_save_is_one_error_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    mgr = _mgr(tmp_path)
    previous = mgr.save(1, _state(1))
    if where == "shards":
        monkeypatch.setattr(manager_module, "FileSystemWriter", _FullDiskWriter)
    else:
        monkeypatch.setattr(os, "fsync", _no_space)  # the first fsync is the per-rank file's
    with pytest.raises(CheckpointError) as err:
        mgr.save(2, _state(2))
    _assert_full_disk_error(err.value, tmp_path, previous)
    monkeypatch.undo()
    # Nothing of the failed save is left, and the previous checkpoint loads intact.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000001"]
    loaded = _state(7)
    assert mgr.load(loaded) == 1
    reference = _state(1)
    assert torch.equal(loaded["model"].weight, reference["model"].weight)
    assert loaded["n"] == 1


def test_full_disk_on_the_command_line_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mgr = _mgr(tmp_path)
    previous = mgr.save(1, _state(1))
    monkeypatch.setattr(manager_module, "FileSystemWriter", _FullDiskWriter)

    def run() -> int:
        mgr.save(2, _state(2))
        return 0

    assert _dispatch(run, "longboat") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("longboat: error: saving checkpoint ") and "\n" not in err
    assert "Traceback" not in err and str(previous) in err


class _Payload:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo crafted",))


def test_crafted_per_rank_state_file_is_refused_naming_it(tmp_path: Path) -> None:
    mgr = _mgr(tmp_path)
    path = mgr.save(1, _state(1))
    crafted = path / "extra_rank0.pt"
    buf = io.BytesIO()
    torch.save({"n": 1}, buf)  # a zip archive whose data.pkl is swapped for a payload
    import zipfile

    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src:
        entries = {info.filename: src.read(info) for info in src.infolist()}
    key = next(k for k in entries if k.endswith("data.pkl"))
    entries[key] = pickle.dumps(_Payload(), protocol=2)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        for name, data in entries.items():
            dst.writestr(name, data)
    crafted.write_bytes(out.getvalue())
    # A consistent manifest: the checksum check passes, the file itself is the problem.
    manifest = read_manifest(path)
    (path / "manifest.json").unlink()
    write_manifest(path, build_manifest(path, step=1, world_size=1, config=manifest.config))
    with pytest.raises(CheckpointCorruptError) as err:
        mgr.load(_state(3), path)
    text = str(err.value)
    assert str(crafted) in text and ("os.system" in text or "posix.system" in text)
    assert "weights_only" not in text and "\n" not in text
    assert err.value.exit_code == 2


def test_a_training_run_on_a_full_disk_stops_with_one_line_and_keeps_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.demo import run

    saves: list[int] = []

    class FillsUpWriter(FileSystemWriter):
        """The disk fills up at the second checkpoint."""

        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            saves.append(1)
            if len(saves) > 1:
                _no_space()
            return super().write_data(plan, planner)

    monkeypatch.setattr(manager_module, "FileSystemWriter", FillsUpWriter)
    cfg = compose_experiment(
        "demo",
        [
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"logging.dir={tmp_path / 'logs'}",
            "logging.progress=false",
            "logging.trackers=[]",
            "train.steps=40",
            "checkpoint.every_steps=20",
        ],
        stack="core",
    )

    def train() -> int:
        run(cfg)
        return 0

    assert _dispatch(train, "longboat") == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"saving checkpoint {tmp_path / 'ckpt' / 'step_00000040'} failed: no space" in err
    assert f"the previous checkpoint {tmp_path / 'ckpt' / 'step_00000020'} is intact" in err
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000020"]
    monkeypatch.undo()
    resumed = run(cfg)
    assert resumed.resumed_from == tmp_path / "ckpt" / "step_00000020"
    assert (resumed.start_step, resumed.end_step) == (20, 40)


def test_full_disk_during_an_async_save_is_one_error_at_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = _mgr(tmp_path)
    previous = mgr.save(1, _state(1))
    monkeypatch.setattr(manager_module, "FileSystemWriter", _FullDiskWriter)
    mgr.save(2, _state(2), async_save=True)
    with pytest.raises(CheckpointError) as err:
        mgr.wait()
    _assert_full_disk_error(err.value, tmp_path, previous)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000001"]
