"""The trainer end to end: validation first, distributed runs with checkpoints + export,
signal handling (SIGUSR1, Ctrl-C with loader workers), bf16, train.compile, the global batch
of the experiments, and the export round trip."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from embodied_testkit import read_metrics
from safetensors.torch import load_file

from longboat.core.checkpoint import CheckpointError
from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.data.batch_plan import batch_layout
from longboat.core.distributed import run_multiprocess
from longboat.embodied.parallel import unwrap
from longboat.embodied.train.export import load_exported_policy
from longboat.embodied.train.trainer import train
from longboat.embodied.train.training import build_training


def _overrides(out: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={out}",
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",  # micro x dp: one micro-batch a step
        "train.log_every=1",
        "logging.progress=false",
        "logging.trackers=[]",
        "data.synthetic.num_episodes=2",
        "data.synthetic.episode_length=12",
        *extra,
    ]


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
                "train.compile=true",  # supported: not among the problems
                "train.eval_every=10",
                "train.precision=fp16",
            ],
            world_size=1,
        )
    assert set(err.value.keys) == {"train.eval_every", "train.precision"}


def _distributed_run(rank: int, world: int, out: str, strategy: str, model: str, data: str) -> dict:
    cfg = compose_experiment(
        f"{model}_tiny",
        _overrides(
            Path(out),
            *data.split(),
            f"parallel.strategy={strategy}",
            "train.global_batch_size=4",
            "train.recompute=full",
        ),
        world_size=world,
    )
    result = train(cfg)
    return {"losses": result.losses, "steps": result.end_step, "export": str(result.export_dir)}


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
    assert result.stopped_by_signal == "SIGUSR1" and result.exit_code == 0
    assert 1 <= result.end_step < 50
    assert result.checkpoint == tmp_path / "checkpoints" / f"step_{result.end_step:08d}"
    assert result.checkpoint.is_dir()
    assert result.export_dir is None  # an interrupted run is not a finished policy
    assert not (tmp_path / "export").exists()


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
    assert [m["step"] for m in read_metrics(tmp_path, "groot_n1_6_tiny")] == [1, 2]
    trace = tmp_path / "logs" / "groot_n1_6_tiny" / "profile" / "trace_steps1-1_rank0.json"
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


def test_ctrl_c_with_loader_workers_saves_and_resumes_the_same_losses(tmp_path: Path) -> None:
    """Ctrl-C reaches every process of the terminal's foreground group: the trainer stops at
    the step boundary and saves; the loader workers (data.num_workers=2) must live on, since
    the main process stops at the end of the step it is in, which (data-bound) is often still
    waiting for its batch. Here the workers get SIGINT after step 2, the main process after
    step 7, past the batches prefetched before: a worker killed by it fails the run. The
    checkpoint of step 7 then resumes to the losses of the uninterrupted run, bit for bit."""
    steps = 10
    extra = (f"train.steps={steps}", "data.num_workers=2", "export.enabled=false")

    def cfg(out: Path):
        return compose_experiment("pi05_tiny", _overrides(out, *extra), world_size=1)

    straight = train(cfg(tmp_path / "straight")).losses
    assert len(straight) == steps and len(set(straight)) == steps

    def ctrl_c(step: int) -> None:
        if step == 2:
            workers = multiprocessing.active_children()
            assert len(workers) == 2, workers
            for worker in workers:
                os.kill(worker.pid, signal.SIGINT)
        if step == 7:
            os.kill(os.getpid(), signal.SIGINT)

    out = tmp_path / "stopped"
    first = train(cfg(out), on_step=ctrl_c)
    assert first.stopped_by_signal == "SIGINT" and first.exit_code == 130
    assert first.end_step == 7 and first.losses == straight[:7]
    assert first.checkpoint == out / "checkpoints" / "step_00000007"
    again = train(cfg(out))
    assert again.resumed_from == first.checkpoint and again.changed == {}
    assert (again.start_step, again.end_step) == (7, steps)
    assert first.losses + again.losses == straight


def test_a_checkpoint_of_another_data_order_is_refused_naming_the_keys(tmp_path: Path) -> None:
    run = compose_experiment("pi05_tiny", _overrides(tmp_path, "export.enabled=false"))
    train(run)
    other = compose_experiment(
        "pi05_tiny", _overrides(tmp_path, "train.steps=3", "data.seed=7", "data.shuffle=false")
    )
    with pytest.raises(CheckpointError) as err:
        train(other)
    text = str(err.value)
    assert "seed=1234 (this run: 7)" in text and "shuffle=True (this run: False)" in text
    assert "data.seed, data.shuffle" in text and "checkpoint.resume=none" in text


@pytest.mark.parametrize("experiment", ["groot_n1_6_tiny", "pi05_tiny"])
def test_the_global_batch_stays_fixed_when_the_data_parallel_size_changes(
    tmp_path: Path, experiment: str
) -> None:
    # train.global_batch_size is the samples of one optimizer step over all ranks, as in the
    # LLM stack: 16 at DP=1 (2 accumulated micro-batches of 8) and at DP=2 (1 per rank).
    for world, accum in ((1, 2), (2, 1)):
        cfg = compose_experiment(experiment, [f"output_dir={tmp_path}"], world_size=world)
        t = cfg.train
        layout = batch_layout(t.global_batch_size, t.micro_batch_size, world)
        assert (layout.global_batch, layout.micro_batch, layout.accum) == (16, 8, accum)
    # null: micro x dp (the global batch grows with the ranks).
    assert batch_layout(None, 8, 2).global_batch == 16 and batch_layout(None, 8, 1).accum == 1


def test_train_compile_compiles_every_parallel_block(tmp_path: Path) -> None:
    built = {}
    for compiled in (False, True):
        cfg = compose_experiment(
            "pi05_tiny",
            _overrides(tmp_path / str(compiled), f"train.compile={str(compiled).lower()}"),
            world_size=1,
        )
        training = build_training(cfg)
        try:
            blocks = unwrap(training.model).parallel_blocks()
            built[compiled] = [b._compiled_call_impl is not None for b in blocks]
            said = " ".join(training.describe())
        finally:
            training.close()
        assert (f"{len(blocks)} blocks torch.compile'd" in said) == compiled
    assert built[True] and all(built[True]) and not any(built[False])


@pytest.mark.slow
def test_train_compile_trains_like_the_eager_run(tmp_path: Path) -> None:
    # torch.compile on CPU (inductor, ~70 s for the first steps on 2 cores).
    losses = {}
    for compiled in ("false", "true"):
        cfg = compose_experiment(
            "pi05_tiny",
            _overrides(tmp_path / compiled, f"train.compile={compiled}", "export.enabled=false"),
            world_size=1,
        )
        losses[compiled] = train(cfg).losses
    assert len(losses["true"]) == 2
    torch.testing.assert_close(
        torch.tensor(losses["true"]), torch.tensor(losses["false"]), rtol=1e-4, atol=0
    )
