"""logging.trackers: a tiny demo run with W&B (offline) and MLflow (file store), read back
with each tool's own reader and compared with metrics.jsonl; a failed or interrupted run
closes its trackers; a named tracker that is not installed is refused before any work."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.demo import run

STEPS = 6


def _cfg(out: Path, *extra: str) -> Any:
    return compose_experiment(
        "demo",
        [
            f"output_dir={out}",
            "logging.progress=false",
            f"train.steps={STEPS}",
            "train.log_every=2",
            "train.eval_every=3",
            "checkpoint.every_steps=0",
            "optim.schedule.warmup_steps=2",
            *extra,
        ],
        stack="core",
    )


def _jsonl(out: Path) -> list[dict[str, Any]]:
    path = out / "logs" / "demo" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Every numeric metric of metrics.jsonl as [(step, value)] (what a tracker is fed)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key in ("step", "time") or isinstance(value, bool | str) or value is None:
                continue
            series.setdefault(key, []).append((row["step"], float(value)))
    return series


def _mlflow_run(out: Path) -> tuple[Any, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "logs" / "demo" / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("longboat")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def test_mlflow_file_store_holds_config_metrics_and_final(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    result = run(_cfg(tmp_path, "logging.trackers=[mlflow]"))
    client, mrun = _mlflow_run(tmp_path)
    assert mrun.info.status == "FINISHED"
    assert mrun.info.run_name == "demo"
    params = mrun.data.params
    assert params["train.steps"] == str(STEPS)
    assert params["optim.schedule.name"] == "cosine"
    assert params["logging.trackers"] == "['mlflow']"
    series = _series(_jsonl(tmp_path))
    assert {"loss", "lr", "eval_mse", "grad_norm"} <= set(series)
    for key, expected in series.items():
        history = client.get_metric_history(mrun.info.run_id, key)
        assert sorted((m.step, m.value) for m in history) == expected, key
    final = {k: v for k, v in mrun.data.metrics.items() if k.startswith("final/")}
    assert final["final/loss"] == result.losses[-1]
    assert final["final/eval_mse"] == result.eval[STEPS]["eval_mse"]
    assert final["final/step"] == STEPS
    config = json.loads(
        (Path(mrun.info.artifact_uri.removeprefix("file://")) / "config.json").read_text()
    )
    assert config["train"]["steps"] == STEPS


def _wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a W&B ``.wandb`` file (a LevelDB-style log: a 7-byte header,
    then 32 KiB blocks of records, each a CRC, a length, a type and its bytes; a record that
    does not fit a block continues in the next as FIRST / MIDDLE / LAST pieces)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, pos, header = 32768, 7, 7
    records, pending = [], b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        piece = data[pos + header : pos + header + length]
        pos += header + length
        if kind == 0 and length == 0:
            continue
        pending += piece
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _history_value(item: Any) -> float:
    kind = item.WhichOneof("value") if "value" in item.DESCRIPTOR.oneofs_by_name else None
    if kind in ("number", "integer"):
        return float(getattr(item, kind))
    return float(json.loads(item.value_json))


def test_wandb_offline_run_holds_config_history_and_summary(tmp_path: Path) -> None:
    wandb = pytest.importorskip("wandb")
    result = run(_cfg(tmp_path, "logging.trackers=[wandb]", "logging.project=tiny"))
    wandb.teardown()  # the W&B service process exits: everything it holds is on disk
    files = list((tmp_path / "logs" / "demo" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    records = _wandb_records(files[0])
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "run" in kinds, kinds
    run_record = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run_record.project, run_record.display_name) == ("tiny", "demo")
    config = {}
    for r in records:
        if r.WhichOneof("record_type") in ("run", "config"):
            items = r.run.config.update if r.HasField("run") else r.config.update
            config.update({i.key: json.loads(i.value_json) for i in items})
    assert config["train"]["steps"] == STEPS
    assert config["logging"]["trackers"] == ["wandb"]
    logged: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r.WhichOneof("record_type") != "history":
            continue
        items = {i.key or ".".join(i.nested_key): i for i in r.history.item}
        step = int(r.history.step.num)
        for key, item in items.items():
            if not key.startswith("_"):
                logged.setdefault(key, []).append((step, _history_value(item)))
    assert logged == _series(_jsonl(tmp_path))
    summary: dict[str, Any] = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({i.key: json.loads(i.value_json) for i in r.summary.update})
    assert summary["final/loss"] == result.losses[-1]
    assert summary["final/eval_mse"] == result.eval[STEPS]["eval_mse"]
    assert summary["final/status"] == "finished"
    assert "exit" in kinds
    exit_record = next(r.exit for r in records if r.WhichOneof("record_type") == "exit")
    assert exit_record.exit_code == 0


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize(("error", "status"), [(_Boom, "FAILED"), (KeyboardInterrupt, "KILLED")])
def test_a_run_that_dies_closes_its_trackers(tmp_path: Path, error: type, status: str) -> None:
    """An error (or a Ctrl-C that interrupts a step) after step 3: the MLflow run ends with
    that status, holding the rows logged up to then."""
    pytest.importorskip("mlflow")

    def die(step: int) -> None:
        if step == 3:
            raise error("stop here")

    with pytest.raises(error):
        run(_cfg(tmp_path, "logging.trackers=[mlflow]"), on_step=die)
    client, mrun = _mlflow_run(tmp_path)
    assert mrun.info.status == status
    assert [m.step for m in client.get_metric_history(mrun.info.run_id, "loss")] == [2]
    assert not any(k.startswith("final/") for k in mrun.data.metrics)


def test_a_tracker_not_installed_is_refused_naming_its_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as Python marks a module not importable
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, "logging.trackers=[tensorboard,wandb]")
    text = str(err.value)
    assert "logging.trackers" in text and "wandb is not installed" in text
    assert 'pip install "longboat-core[wandb]"' in text
    assert not (tmp_path / "logs").exists()


def test_unknown_tracker_and_old_key_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown tracker 'comet'.*tensorboard, wandb, mlflow"):
        _cfg(tmp_path, "logging.trackers=[comet]")
    with pytest.raises(ConfigError, match=r"logging\.tensorboard.*renamed to logging\.trackers"):
        _cfg(tmp_path, "logging.tensorboard=false")
