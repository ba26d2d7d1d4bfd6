"""SIGKILL a training process mid-run, resume: the per-step losses continue exactly."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
from llm_testkit import compose, make_tiny_dataset, tiny_overrides

from longboat.core.distributed import run_multiprocess

STEPS, SAVE_EVERY, KILL_AT = 10, 3, 7


def _overrides(data: Path, tok: Path, out: Path) -> list[str]:
    return [
        *tiny_overrides(data, tok, out, steps=STEPS),
        f"checkpoint.every_steps={SAVE_EVERY}",
        "checkpoint.resume=auto",
        "checkpoint.keep_last=0",
        "checkpoint.save_on_exit=true",  # a stop signal saves
    ]


def _run_worker(rank: int, world: int, overrides: list[str]) -> tuple[int, list[float]]:
    from longboat.llm.train.training import train as run

    result = run(compose(overrides))
    return result.start_step, result.losses


def _killed_run(overrides: list[str]) -> None:
    import torch

    from longboat.llm.train.training import train as run

    # A forked child must not use the parent's OpenMP pool (it can hang after fork).
    torch.set_num_threads(1)

    def on_step(step: int) -> None:
        if step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    run(compose(overrides), on_step=on_step)


def _losses(metrics: Path) -> dict[int, float]:
    by_step: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            by_step[row["step"]] = row["loss"]  # a resumed run repeats steps: keep the latest
    return by_step


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_sigkill_then_resume_continues_the_loss_curve(tmp_path: Path) -> None:
    import megatron.core.optimizer  # noqa: F401  (import once; forked processes share it)

    data, tok = make_tiny_dataset(tmp_path / "data")
    ref_out, out = tmp_path / "reference", tmp_path / "interrupted"
    start, ref = run_multiprocess(_run_worker, 1, _overrides(data, tok, ref_out))[0]
    assert start == 0 and len(ref) == STEPS

    proc = mp.get_context("fork").Process(target=_killed_run, args=(_overrides(data, tok, out),))
    proc.start()
    proc.join(120)
    hung = proc.exitcode is None
    if hung:
        proc.kill()  # also a SIGKILL: must not pass for the kill at step KILL_AT below
        proc.join()
    assert not hung, f"the training run did not reach its kill at step {KILL_AT} within 120 s"
    assert proc.exitcode == -signal.SIGKILL, f"the run was not killed (exit {proc.exitcode})"
    last = (KILL_AT // SAVE_EVERY) * SAVE_EVERY
    assert (out / "ckpt" / f"step_{last:08d}").is_dir()

    start, resumed = run_multiprocess(_run_worker, 1, _overrides(data, tok, out))[0]
    assert start == last, f"resumed from step {start}, expected the step-{last} checkpoint"
    assert resumed == ref[last:], "the resumed steps must reproduce the uninterrupted losses"
    # The metrics file (killed run + resumed run) holds the uninterrupted curve exactly.
    ref_curve = _losses(ref_out / "logs" / "quickstart" / "metrics.jsonl")
    curve = _losses(out / "logs" / "quickstart" / "metrics.jsonl")
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert curve == ref_curve
    assert ref[-1] < ref[0], "the loss must fall (a frozen model would resume trivially)"


def _sigterm_worker(rank: int, world: int, overrides: list[str]) -> tuple[str | None, int, bool]:
    from longboat.llm.train.training import train as run

    def on_step(step: int) -> None:
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    result = run(compose(overrides), on_step=on_step)
    return result.stopped_by_signal, result.end_step, result.export_dir is not None


@pytest.mark.multiprocess
def test_sigterm_saves_a_checkpoint_and_stops(tmp_path: Path) -> None:
    data, tok = make_tiny_dataset(tmp_path / "data")
    overrides = [*_overrides(data, tok, tmp_path / "run"), "export.enabled=true"]
    stopped, step, exported = run_multiprocess(_sigterm_worker, 1, overrides)[0]
    assert (stopped, step, exported) == ("SIGTERM", 4, False)
    assert (tmp_path / "run" / "ckpt" / "step_00000004").is_dir()


def _stop_at_worker(
    rank: int, world: int, overrides: list[str], stop_at: int
) -> tuple[int, list[float]]:
    from longboat.llm.train.training import train as run

    def on_step(step: int) -> None:
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)

    result = run(compose(overrides, world_size=world), on_step=on_step if stop_at else None)
    return result.start_step, result.losses


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout", ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"], ids=["tp2", "pp2"]
)
def test_resume_is_exact_under_model_parallelism(layout: str, tmp_path: Path) -> None:
    """Sharded model + distributed-optimizer state: stop at step 4, resume, same losses."""
    data, tok = make_tiny_dataset(tmp_path / "data")
    ref = run_multiprocess(
        _stop_at_worker, 2, [*_overrides(data, tok, tmp_path / "ref"), layout], 0
    )
    overrides = [*_overrides(data, tok, tmp_path / "run"), layout]
    first = run_multiprocess(_stop_at_worker, 2, overrides, 4)
    assert all(start == 0 and len(losses) == 4 for start, losses in first)
    resumed = run_multiprocess(_stop_at_worker, 2, overrides, 0)
    for (start, losses), (_, ref_losses) in zip(resumed, ref, strict=True):
        assert start == 4
        assert losses == ref_losses[4:], "resumed losses differ from the uninterrupted run"


def _lr_worker(rank: int, world: int, overrides: list[str]) -> tuple[int, list[float], dict]:
    """Run, recording the LR of every update of megatron's inner AdamW (what it really used)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from longboat.llm.train.training import train as run

    used: list[float] = []
    handle = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: used.append(float(opt.param_groups[0]["lr"]))
    )
    try:
        result = run(compose(overrides))
    finally:
        handle.remove()
    return result.start_step, used, result.changed


@pytest.mark.multiprocess
def test_resume_with_new_steps_and_lr_follows_the_new_schedule(tmp_path: Path) -> None:
    """A finished 6-step run resumed with train.steps=10 optim.lr=2e-2 min_lr_ratio=0.5: the
    updates 7..10 use the new schedule at positions 6..9 (what an uninterrupted 10-step run
    with those settings uses there), not the checkpoint's LR."""
    data, tok = make_tiny_dataset(tmp_path / "data")
    # megatron's step, whose inner AdamW.step() the worker's hook sees (the one-pass update
    # reads the same param-group LR without calling it).
    base = [*tiny_overrides(data, tok, tmp_path / "run", steps=6), "checkpoint.resume=auto",
            "checkpoint.save_on_exit=true", "optim.one_pass_adamw=false"]  # fmt: skip
    start, first, _ = run_multiprocess(_lr_worker, 1, base)[0]
    assert start == 0 and len(first) == 6
    new = ["train.steps=10", "optim.lr=0.02", "optim.schedule.min_lr_ratio=0.5"]
    start, resumed, changed = run_multiprocess(_lr_worker, 1, [*base, *new])[0]
    assert start == 6 and len(resumed) == 4
    assert changed["train.steps"] == (6, 10) and changed["optim.lr"] == (0.01, 0.02)
    fresh = [*tiny_overrides(data, tok, tmp_path / "fresh", steps=10), *new, base[-1]]
    _, straight, _ = run_multiprocess(_lr_worker, 1, fresh)[0]
    assert resumed == straight[6:]
    assert resumed[-1] > 0.02 * 0.5 and first[-1] < resumed[0]


def _layout_worker(rank: int, world: int, overrides: list[str]) -> str:
    from longboat.core.checkpoint import CheckpointError
    from longboat.llm.train.training import train as run

    try:
        run(compose(overrides, world_size=world))
    except CheckpointError as exc:
        return str(exc)
    return ""


@pytest.mark.multiprocess
def test_a_changed_parallel_layout_is_named_not_a_dcp_traceback(tmp_path: Path) -> None:
    data, tok = make_tiny_dataset(tmp_path / "data")
    base = [*_overrides(data, tok, tmp_path / "run")]
    run_multiprocess(_stop_at_worker, 2, [*base, "parallel.tensor_parallel=2"], 0)
    messages = run_multiprocess(_layout_worker, 2, [*base, "train.steps=12"])
    for msg in messages:
        assert "parallel.tensor_parallel=2 (this run: 1)" in msg, msg
        assert "checkpoint.resume=none" in msg and "Missing key" not in msg


@pytest.mark.multiprocess
def test_a_changed_moe_experts_layout_is_named(tmp_path: Path) -> None:
    """Grouped and per-expert experts store different tensors: resuming across them stops
    before anything loads, naming ``model.moe_experts`` and the fix."""
    data, tok = make_tiny_dataset(tmp_path / "data")
    base = ["model=qwen3_moe_tiny", *_overrides(data, tok, tmp_path / "run")]
    run_multiprocess(_stop_at_worker, 1, [*base, "model.moe_experts=sequential"], 0)
    (msg,) = run_multiprocess(_layout_worker, 1, [*base, "train.steps=12"])
    assert "model.moe_experts='sequential' (this run: 'auto')" in msg, msg
    assert "checkpoint.resume=none" in msg
