"""Exact resume after SIGKILL, through the real ``longboat-embodied train`` command.

An uninterrupted run and a run that is SIGKILLed right after a periodic checkpoint
and then relaunched (``checkpoint.resume=auto``) must log bit-identical losses for
every step (CPU, fp32): the checkpoint restores model, optimizer, LR schedule, data
position, NaN-guard counters and RNG, and every micro-batch's RNG is seeded from
(seed, step, micro-batch), so the resumed run continues the exact loss curve.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from longboat.core.config.compose import compose_experiment
from longboat.embodied.train.trainer import train

STEPS = 4
KILL_AFTER_CHECKPOINT = 2  # every_steps; the kill lands while step 3.. is running


def _overrides(out: Path, data: Path | None) -> list[str]:
    args = [
        f"output_dir={out}",
        f"train.steps={STEPS}",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",  # micro x dp: one micro-batch a step
        "train.log_every=1",
        f"checkpoint.every_steps={KILL_AFTER_CHECKPOINT}",
        "checkpoint.keep_last=0",
        "logging.progress=false",
        "logging.trackers=[]",
        "export.enabled=false",
        "data.synthetic.num_episodes=2",
        "data.synthetic.episode_length=12",
        "optim.schedule.warmup_steps=2",
    ]
    if data is not None:
        args.append(f"data.path={data}")
    return args


def _cmd(out: Path, data: Path | None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "longboat.embodied.cli",
        "train",
        "experiment=groot_n1_6_tiny",
        *_overrides(out, data),
    ]


def _train_to_end(out: Path, data: Path | None) -> None:
    """The same command run to completion in a fresh process (no state from other tests)."""
    done = subprocess.run(_cmd(out, data), env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", LONGBOAT_ACCELERATOR="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _losses(out: Path) -> dict[int, float]:
    """Loss per step from metrics.jsonl (a resumed run appends; the last line of a step wins)."""
    losses = {}
    for line in (out / "logs" / "groot_n1_6_tiny" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        losses[record["step"]] = record["loss"]
    return losses


@pytest.mark.multiprocess
def test_sigkill_then_resume_continues_the_exact_loss_curve(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    _train_to_end(straight, None)
    reference = _losses(straight)
    assert sorted(reference) == list(range(1, STEPS + 1))

    killed = tmp_path / "killed"
    data = straight / "dataset"  # the same generated dataset, not regenerated
    proc = subprocess.Popen(
        _cmd(killed, data), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    first_ckpt = killed / "checkpoints" / f"step_{KILL_AFTER_CHECKPOINT:08d}"
    deadline = time.monotonic() + 120
    while not first_ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first_ckpt.exists(), (
        proc.stderr.read().decode() if proc.poll() is not None else "timeout"
    )
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    before = _losses(killed)
    assert max(before) < STEPS, "the run finished before the kill; the test proves nothing"

    _train_to_end(killed, data)
    resumed = _losses(killed)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    # A restart from step 0 would reproduce the curve too: the checkpointed steps must be
    # logged once (by the killed run), not again by the relaunch.
    logged = (killed / "logs" / "groot_n1_6_tiny" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in logged]
    repeated = [s for s in range(1, KILL_AFTER_CHECKPOINT + 1) if steps.count(s) != 1]
    assert not repeated, f"the relaunch did not resume from the checkpoint: steps {steps}"
    # Bit-identical: same floats, not merely close.
    assert resumed == reference, {s: (resumed[s], reference[s]) for s in reference}


def _resume_at_world2(rank: int, world: int, out: str, data: str, strategy: str) -> list[float]:
    cfg = compose_experiment(
        "groot_n1_6_tiny",
        [
            *_overrides(Path(out), Path(data)),
            "train.micro_batch_size=1",
            "train.global_batch_size=2",
            f"parallel.strategy={strategy}",
        ],
        world_size=world,
    )
    return train(cfg).losses


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_at_another_world_size_and_strategy(tmp_path: Path, strategy: str) -> None:
    """A world-size-1 checkpoint resumes on 2 ranks (DCP reshards; the batch plan and the
    per-micro-batch RNG do not depend on the world size): same losses within 1e-5 relative."""
    from longboat.core.distributed import run_multiprocess

    straight = tmp_path / "straight"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = compose_experiment(
            "groot_n1_6_tiny",
            [*_overrides(straight, None), "train.micro_batch_size=1", "train.global_batch_size=2"],
            world_size=1,
        )
        reference = train(cfg).losses
    finally:
        torch.set_num_threads(threads)
    moved = tmp_path / "moved"
    ckpt = f"step_{KILL_AFTER_CHECKPOINT:08d}"
    shutil.copytree(straight / "checkpoints" / ckpt, moved / "checkpoints" / ckpt)
    results = run_multiprocess(
        _resume_at_world2, 2, str(moved), str(straight / "dataset"), strategy, timeout=240
    )
    torch.testing.assert_close(
        torch.tensor(results[0], dtype=torch.float64),
        torch.tensor(reference[KILL_AFTER_CHECKPOINT:], dtype=torch.float64),
        rtol=1e-5,
        atol=0.0,
    )


def test_master_weights_resume_continues_the_exact_loss_curve(tmp_path: Path) -> None:
    """train.master_weights: the DCP checkpoint holds the bf16 params and the optimizer's
    fp32 master weights, moments and step count (per parameter, by FQN), and loading copies
    them back into the flat buffers: steps 3-4 after a resume from step 2 are bit-identical."""
    extra = ["train.precision=bf16", "train.master_weights=true"]
    straight = tmp_path / "straight"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = train(
            compose_experiment(
                "groot_n1_6_tiny", [*_overrides(straight, None), *extra], world_size=1
            )
        ).losses
        moved = tmp_path / "moved"
        ckpt = f"step_{KILL_AFTER_CHECKPOINT:08d}"
        shutil.copytree(straight / "checkpoints" / ckpt, moved / "checkpoints" / ckpt)
        result = train(
            compose_experiment(
                "groot_n1_6_tiny",
                [*_overrides(moved, straight / "dataset"), *extra],
                world_size=1,
            )
        )
    finally:
        torch.set_num_threads(threads)
    assert result.start_step == KILL_AFTER_CHECKPOINT
    assert result.resumed_from == moved / "checkpoints" / ckpt
    assert len(set(reference)) == STEPS
    assert result.losses == reference[KILL_AFTER_CHECKPOINT:]
    # An autocast run cannot load a master-weight optimizer state: the key is named (and the
    # fix given) before anything loads.
    from longboat.core.checkpoint.errors import CheckpointError

    autocast = [*_overrides(moved, straight / "dataset"), "train.precision=bf16",
                "train.master_weights=false"]  # fmt: skip
    with pytest.raises(CheckpointError, match=r"train\.master_weights=True \(this run: False\)"):
        train(compose_experiment("groot_n1_6_tiny", autocast, world_size=1))
