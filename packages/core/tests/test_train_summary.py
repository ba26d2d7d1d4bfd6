"""What a run reports at its end compares the loss at its two ends, also when it is short,
and stepping the LR schedule after an update that bypassed ``optimizer.step()`` (a fused or
one-pass update) raises no warning."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

from longboat.core.config.compose import compose_experiment
from longboat.core.demo import run


def _run(tmp_path: Path, steps: int):
    cfg = compose_experiment(
        "demo",
        [f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'logs'}",
         "logging.progress=false", "logging.trackers=[]", f"train.steps={steps}"],
        stack="core",
    )  # fmt: skip
    return run(cfg)


def test_a_short_runs_summary_compares_its_first_and_last_steps(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    two = _run(tmp_path / "two", 2)
    out = " ".join(capsys.readouterr().out.split())
    a, b = two.losses
    assert a != b
    assert f"Train loss (mean of first/last step): {a:.4f} -> {b:.4f}" in out, out
    six = _run(tmp_path / "six", 6)
    out = " ".join(capsys.readouterr().out.split())
    head, tail = sum(six.losses[:3]) / 3, sum(six.losses[3:]) / 3
    assert f"Train loss (mean of first/last 3 steps): {head:.4f} -> {tail:.4f}" in out, out
    one = _run(tmp_path / "one", 1)
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(rf"Trained steps 1\.\.1 in .*Train loss: {one.losses[0]:.4f} \(one step\)",
                     out), out  # fmt: skip


def test_the_schedule_steps_quietly_after_an_update_outside_optimizer_step() -> None:
    from omegaconf import OmegaConf

    from longboat.core.config.schema import LRScheduleConfig
    from longboat.core.train.schedule import RunSchedule

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    schedule = RunSchedule([opt], OmegaConf.structured(LRScheduleConfig(warmup_steps=2)), 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            with torch.no_grad():  # the update, written by a fused kernel in a real step
                p.sub_(0.1 * opt.param_groups[0]["lr"])
            schedule.step()
    assert schedule.position == 3


def test_a_curve_of_few_logged_steps_draws_its_points(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from longboat.core.train.rundir import loss_curve_figure, plot_loss_curve

    one = loss_curve_figure({5: 2.5}, {})
    (line,) = one.axes[0].lines
    assert line.get_marker() == "o" and list(line.get_xdata()) == [5]  # a visible point
    many = loss_curve_figure({s: 1.0 / s for s in range(1, 101)}, {})
    assert many.axes[0].lines[0].get_marker() in ("None", None, "")
    plt.close("all")
    # A run of one logged step still writes its curve.
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 5, "loss": 2.5}\n')
    assert plot_loss_curve(metrics) == tmp_path / "loss_curve.png"
