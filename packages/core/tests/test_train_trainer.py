"""Core's trainer (``longboat.core.train``) through the demo: resume that follows the config,
damaged checkpoints, a fresh start that sets the old run aside, Ctrl-C, the run's files."""

from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from longboat.core.checkpoint import CheckpointCorruptError, CheckpointError, CheckpointWarning
from longboat.core.cli import main
from longboat.core.config.compose import compose_experiment
from longboat.core.demo import run
from longboat.core.loop.lr_schedule import make_schedule_fn


def _overrides(out: Path, *extra: str) -> list[str]:
    return [f"output_dir={out}", "logging.progress=false", "logging.trackers=[]", *extra]


def _cfg(out: Path, *extra: str):
    return compose_experiment("demo", _overrides(out, *extra), stack="core")


def _rows(out: Path) -> list[dict]:
    path = out / "logs" / "demo" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _lr_by_step(out: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in _rows(out) if "lr" in r}


def test_resume_follows_the_new_steps_lr_and_schedule(tmp_path: Path) -> None:
    """A finished 30-step run resumed with train.steps=60 optim.lr=2e-2 min_lr_ratio=0.5: every
    new step runs at the new schedule's LR at its position (not the checkpoint's floor LR),
    exactly the LR an uninterrupted 60-step run with those settings has there."""
    first = run(_cfg(tmp_path / "run", "train.steps=30", "train.log_every=1"))
    assert first.end_step == 30
    floor = 1e-2 * 0.05  # the demo's optim.lr x min_lr_ratio: where the first run ended
    assert _lr_by_step(tmp_path / "run")[30] == pytest.approx(floor)

    new = [
        "train.steps=60",
        "train.log_every=1",
        "optim.lr=2e-2",
        "optim.schedule.min_lr_ratio=0.5",
    ]
    again = run(_cfg(tmp_path / "run", *new))
    assert (again.start_step, again.end_step) == (30, 60)
    assert again.changed["train.steps"] == (30, 60)
    assert again.changed["optim.lr"] == (0.01, 0.02)
    assert again.changed["optim.schedule.min_lr_ratio"] == (0.05, 0.5)
    fn = make_schedule_fn(OmegaConf.to_object(_cfg(tmp_path / "x", *new)).optim.schedule, 60)
    lrs = _lr_by_step(tmp_path / "run")
    for step in range(31, 61):  # the LR logged after step s is the one of update s + 1
        assert lrs[step] == pytest.approx(2e-2 * fn(step), rel=1e-12), step
    assert lrs[31] > 10 * floor and lrs[60] == pytest.approx(2e-2 * 0.5)
    assert run(_cfg(tmp_path / "fresh", *new)).end_step == 60
    fresh_lrs = _lr_by_step(tmp_path / "fresh")
    assert [lrs[s] for s in range(31, 61)] == [fresh_lrs[s] for s in range(31, 61)]
    assert sorted(lrs) == list(range(1, 61))  # every step once


def test_damaged_latest_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(_cfg(out, "train.steps=20", "checkpoint.every_steps=10"))
    ckpts = out / "checkpoints"
    shard = ckpts / "step_00000020" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with pytest.warns(CheckpointWarning, match=r"step_00000020 is damaged .*step_00000010"):
        resumed = run(_cfg(out, "train.steps=30", "checkpoint.every_steps=10"))
    assert resumed.resumed_from == ckpts / "step_00000010"
    assert (resumed.start_step, resumed.end_step) == (10, 30)
    assert (ckpts / "step_00000020.damaged").is_dir()  # set aside, never deleted
    # The uninterrupted run: the fallback retrained steps 11..20 to the same losses.
    full = run(_cfg(tmp_path / "full", "train.steps=30"))
    assert resumed.losses == full.losses[10:]
    rows = [r["step"] for r in _rows(out) if "loss" in r]
    assert len(rows) == len(set(rows)), "a step appears twice in metrics.jsonl"


def test_checksum_mismatch_and_missing_metadata_fall_back_too(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(_cfg(out, "train.steps=30", "checkpoint.every_steps=10", "checkpoint.keep_last=3"))
    ckpts = out / "checkpoints"
    extra = ckpts / "step_00000030" / "extra_rank0.pt"
    data = bytearray(extra.read_bytes())
    data[-20] ^= 0xFF  # one flipped byte: same size, other checksum
    extra.write_bytes(bytes(data))
    (ckpts / "step_00000020" / ".metadata").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = run(_cfg(out, "train.steps=31"))
    messages = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert any("step_00000030 is damaged (" in m and "checksum mismatch" in m for m in messages)
    assert any("step_00000020 is damaged (" in m and "missing .metadata" in m for m in messages)
    assert resumed.resumed_from == ckpts / "step_00000010"


def test_every_checkpoint_damaged_stops_the_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(_cfg(out, "train.steps=10"))
    (out / "checkpoints" / "step_00000010" / ".metadata").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"every checkpoint in .* is damaged"):
        run(_cfg(out, "train.steps=20"))


def test_a_finished_run_started_again_says_so_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    assert main(["demo", *_overrides(out, "train.steps=10")]) == 0
    capsys.readouterr()
    latest = out / "checkpoints" / "step_00000010"
    for steps in (10, 4):  # the same train.steps, and fewer than the checkpoint's step
        assert main(["demo", *_overrides(out, f"train.steps={steps}")]) == 0
        lines = [
            line for line in capsys.readouterr().out.splitlines() if "already finished" in line
        ]
        assert lines == [
            f"Run already finished at step 10 (checkpoint {latest}): nothing to train; raise "
            "train.steps above 10 to train further (e.g. train.steps=20), or "
            "checkpoint.resume=none to start over."
        ]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000010"]


def test_explicit_damaged_resume_exits_2_naming_the_file_and_the_previous(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    run(_cfg(out, "train.steps=20", "checkpoint.every_steps=10"))
    capsys.readouterr()
    latest = out / "checkpoints" / "step_00000020"
    shard = latest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-7])
    code = main(["demo", *_overrides(out, "train.steps=30", f"checkpoint.resume={latest}")])
    err = capsys.readouterr().err
    assert code == 2
    assert "__0_0.distcp has" in err and "truncated" in err
    assert f"checkpoint.resume={out / 'checkpoints' / 'step_00000010'}" in err
    assert "Traceback" not in err
    assert latest.is_dir()  # an explicit path is reported, not moved


def test_resume_none_sets_the_previous_run_aside(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(_cfg(out, "train.steps=10"))
    fresh = run(_cfg(out, "train.steps=5", "checkpoint.resume=none"))
    assert fresh.resumed_from is None and fresh.start_step == 0
    aside = sorted(p.name for p in out.iterdir() if ".set-aside-" in p.name)
    assert len(aside) == 1 and aside[0].startswith("checkpoints.set-aside-")
    assert len(list((out / "logs").glob("demo.set-aside-*"))) == 1
    # A later default run resumes the new run, not the stale one.
    later = run(_cfg(out, "train.steps=8"))
    assert later.resumed_from == out / "checkpoints" / "step_00000005"
    assert [r["step"] for r in _rows(out) if "loss" in r] == [5, 8]  # log_every=5, no stale rows


def test_metrics_hold_each_step_once_after_a_crash_past_the_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(_cfg(out, "train.steps=25", "train.log_every=1", "checkpoint.every_steps=10"))
    # As if the process died after step 25 was logged but before its checkpoint was written.
    for step in (25,):
        target = out / "checkpoints" / f"step_{step:08d}"
        target.rename(target.with_name("gone"))
    resumed = run(_cfg(out, "train.steps=25", "train.log_every=1", "checkpoint.every_steps=10"))
    assert resumed.start_step == 20
    steps = [r["step"] for r in _rows(out) if "loss" in r]
    assert steps == list(range(1, 26))


def test_ctrl_c_saves_and_the_resumed_run_matches(tmp_path: Path) -> None:
    full = run(_cfg(tmp_path / "full", "train.steps=24"))

    def ctrl_c_at_9(step: int) -> None:
        if step == 9:
            os.kill(os.getpid(), signal.SIGINT)

    stopped = run(_cfg(tmp_path / "split", "train.steps=24"), on_step=ctrl_c_at_9)
    assert (stopped.stopped_by_signal, stopped.end_step, stopped.exit_code) == ("SIGINT", 9, 130)
    assert stopped.checkpoint == tmp_path / "split" / "checkpoints" / "step_00000009"
    assert stopped.export_dir is None
    resumed = run(_cfg(tmp_path / "split", "train.steps=24"))
    assert stopped.losses + resumed.losses == full.losses  # exact


def test_ctrl_c_without_save_on_exit_saves_nothing(tmp_path: Path) -> None:
    def ctrl_c_at_3(step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    stopped = run(
        _cfg(tmp_path, "train.steps=24", "checkpoint.save_on_exit=false"), on_step=ctrl_c_at_3
    )
    assert stopped.stopped_by_signal == "SIGINT" and stopped.checkpoint is None


def test_a_changed_model_shape_is_refused_before_loading(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(_cfg(out, "train.steps=5"))
    with pytest.raises(
        CheckpointError, match=r"saved with model\.hidden_size=128 \(this run: 64\)"
    ):
        run(_cfg(out, "train.steps=10", "model.hidden_size=64"))


def test_another_stacks_checkpoint_is_refused(tmp_path: Path) -> None:
    """Two stacks' experiments of one name (``quickstart``) in one output_dir: the second
    run names the stack instead of loading the first run's state."""
    out = tmp_path / "run"
    run(_cfg(out, "train.steps=5"))
    other = _cfg(out, "train.steps=10")
    other.stack = "other"
    with pytest.raises(CheckpointError, match=r"saved with stack='core' \(this run: 'other'\)"):
        run(other)


def test_the_run_writes_its_config_and_loss_curve(tmp_path: Path) -> None:
    result = run(_cfg(tmp_path, "train.steps=12", "optim.lr=0.02"))
    saved = OmegaConf.load(result.metrics_path.with_name("config.yaml"))
    assert saved.optim.lr == 0.02 and saved.train.steps == 12 and saved.output_dir == str(tmp_path)
    assert result.plot_path == result.metrics_path.with_name("loss_curve.png")
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_progress_line_has_a_loss_from_the_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Without a per-step host read (guard off), the first step is still read: its progress
    line shows a loss, not ``loss -``."""
    cfg = compose_experiment(
        "demo",
        [f"output_dir={tmp_path}", "logging.trackers=[]", "logging.progress=true",
         "train.steps=5", "train.log_every=100", "train.nan_guard.enabled=false"],
        stack="core",
    )  # fmt: skip
    capsys.readouterr()
    run(cfg)
    captured = capsys.readouterr()
    first = [ln for ln in (captured.out + captured.err).splitlines() if "step 1/5" in ln]
    assert first and "loss -" not in first[-1], first
    assert float(first[-1].split("loss ")[1].split()[0]) > 0


def test_a_runs_own_callbacks_are_called_after_every_step(tmp_path: Path) -> None:
    """``Training.callbacks()`` joins the trainer's callbacks (a stack's periodic work, e.g.
    the diffusion previews), called once per step with the step number."""
    from longboat.core.demo import DemoTraining
    from longboat.core.train import Trainer, typed_config
    from longboat.core.train.trainer import Callback

    seen: list[int] = []

    class Record(Callback):
        def on_step_end(self, trainer, step, out) -> None:  # type: ignore[no-untyped-def]
            seen.append(step)

    class WithCallbacks(DemoTraining):
        def callbacks(self) -> list[Callback]:
            return [Record()]

    cfg = typed_config(_cfg(tmp_path, "train.steps=3"))
    training = WithCallbacks(cfg)
    try:
        Trainer(cfg, training).fit()
    finally:
        training.close()
    assert seen == [1, 2, 3]
