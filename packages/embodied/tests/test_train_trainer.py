"""The trainer end to end: validation first, distributed runs with checkpoints + export,
signal handling, bf16, and the export round trip."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess
from longboat.embodied.train.export import load_exported_policy
from longboat.embodied.train.trainer import train


def _overrides(out: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={out}",
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.log_every=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        "data.synthetic.num_episodes=2",
        "data.synthetic.episode_length=12",
        *extra,
    ]


def _metrics(out: Path, run: str) -> list[dict]:
    path = out / "logs" / run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bad_config_fails_before_heavy_init(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        compose_experiment(
            "groot_n1_6_tiny",
            [f"output_dir={tmp_path}", "parallel.strategy=zero3", "model.name=groot"],
            world_size=1,
        )
    text = str(err.value)
    assert "parallel.strategy" in text and "zero3" in text
    assert "model.name" in text
    assert not (tmp_path / "dataset").exists()  # nothing was generated or built


def test_unsupported_switches_are_rejected_not_ignored(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        compose_experiment(
            "pi05_tiny",
            [
                f"output_dir={tmp_path}",
                "train.compile=true",
                "train.eval_every=10",
                "train.precision=fp16",
            ],
            world_size=1,
        )
    assert {"train.compile", "train.eval_every", "train.precision"} <= set(err.value.keys)


def _distributed_run(rank: int, world: int, out: str, strategy: str, model: str, data: str) -> dict:
    cfg = compose_experiment(
        f"{model}_tiny",
        _overrides(
            Path(out),
            *data.split(),
            f"parallel.strategy={strategy}",
            "train.global_batch_size=4",
            "train.activation_checkpointing=full",
        ),
        world_size=world,
    )
    result = train(cfg)
    return {"losses": result.losses, "steps": result.steps_done, "export": result.export_dir}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("strategy", "model", "data"),
    [
        # two embodiments (category-specific weights, different state/action dims), v3.0
        ("fsdp", "groot_n1_6", "data.synthetic.num_embodiments=2"),
        ("zero1", "pi05", "data.synthetic.layout=v2.1"),
    ],
)
def test_trainer_world2_checkpoints_and_exports(
    tmp_path: Path, strategy: str, model: str, data: str
) -> None:
    results = run_multiprocess(
        _distributed_run, 2, str(tmp_path), strategy, model, data, timeout=180
    )
    assert results[0]["losses"] == results[1]["losses"]  # the reported loss is the global mean
    assert results[0]["steps"] == 2
    assert (tmp_path / "checkpoints" / "step_00000002").is_dir()
    export = Path(results[0]["export"])
    weights = load_file(str(export / "model.safetensors"))
    config = json.loads((export / "config.json").read_text())
    assert config["model_name"] == model and config["trained_steps"] == 2
    policy = load_exported_policy(export)
    own = policy.state_dict()
    assert sorted(own) == sorted(weights)  # full, unsharded, the policy's own names
    for key, value in weights.items():
        assert torch.equal(own[key], value), key


def test_sigusr1_saves_and_exits_cleanly(tmp_path: Path) -> None:
    cfg = compose_experiment(
        "pi05_tiny",
        _overrides(tmp_path, "train.steps=50", "checkpoint.every_steps=0"),
        world_size=1,
    )
    metrics = tmp_path / "logs" / "pi05_tiny" / "metrics.jsonl"

    def send_signal_after_first_step() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().strip():
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            time.sleep(0.05)

    sender = threading.Thread(target=send_signal_after_first_step, daemon=True)
    sender.start()
    result = train(cfg)
    sender.join()
    assert result.interrupted
    assert 1 <= result.steps_done < 50
    assert (tmp_path / "checkpoints" / f"step_{result.steps_done:08d}").is_dir()
    assert result.export_dir is None  # an interrupted run is not a finished policy


def test_bf16_autocast_run_is_finite(tmp_path: Path) -> None:
    cfg = compose_experiment(
        "groot_n1_6_tiny",
        _overrides(
            tmp_path,
            "train.precision=bf16",
            "export.enabled=false",
            "train.profiler.enabled=true",
            "train.profiler.start_step=1",
            "train.profiler.end_step=1",
        ),
        world_size=1,
    )
    result = train(cfg)
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    assert [m["step"] for m in _metrics(tmp_path, "groot_n1_6_tiny")] == [1, 2]
    trace = tmp_path / "profile" / "trace_steps1-1_rank0.json"
    assert "ProfilerStep#1" in trace.read_text()


def test_loader_workers_do_not_change_the_run(tmp_path: Path) -> None:
    # The batch plan is a function of the step and data-side RNG is seeded per micro-batch,
    # so worker processes (which prefetch ahead) give the same losses as the main process.
    runs = {}
    for workers in (0, 2):
        cfg = compose_experiment(
            "pi05_tiny",
            _overrides(
                tmp_path / f"w{workers}",
                "train.steps=3",
                f"data.num_workers={workers}",
                "export.enabled=false",
                "checkpoint.save_on_exit=false",
            ),
            world_size=1,
        )
        runs[workers] = train(cfg).losses
    assert runs[0] == runs[2]
