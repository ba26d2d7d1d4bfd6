"""The ``longboat`` command and ``stack_main`` plumbing, against a fake installed stack."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from fake_stack import write_fake_stack
from omegaconf import OmegaConf

from longboat.core import cli
from longboat.core.cli import EXIT_CONFIG_ERROR, main, stack_main


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """Stack ``fake`` installed through a dist-info in ``site`` (on sys.path)."""
    site = tmp_path / "site"
    write_fake_stack(site, "fake", module=f"fake_cli_{uuid.uuid4().hex[:8]}")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return site


def test_stacks_lists_installed_stacks_with_descriptions(site, capsys):
    assert main(["stacks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "core"
    fake = next(line for line in lines if line.startswith("fake "))
    assert "Fake stack for tests." in fake and "[longboat-fake]" in fake


def test_config_list(site, capsys):
    assert main(["config", "list"]) == 0
    assert "fake: no_model, not_global, tiny" in capsys.readouterr().out.splitlines()


def test_config_show_prints_resolved_yaml(site, capsys):
    assert main(["config", "show", "tiny", "optim.lr=0.25", "train.steps=9"]) == 0
    shown = OmegaConf.create(capsys.readouterr().out)
    assert shown.experiment == "tiny" and shown.stack == "fake"
    assert shown.optim.lr == 0.25 and shown.train.steps == 9
    assert shown.model.num_attention_heads == 4
    assert shown.checkpoint.dir == "outputs/fake/checkpoints"  # interpolation resolved


def test_config_show_bad_key_exits_2_with_the_error_text(site, capsys):
    assert main(["config", "show", "tiny", "optim.lrr=1"]) == EXIT_CONFIG_ERROR
    out, err = capsys.readouterr()
    assert out == ""
    assert "longboat: Invalid config: optim.lrr=1: unknown key" in err
    assert "did you mean 'optim.lr'?" in err
    assert "Traceback" not in err


def test_config_show_checks_layout_for_world_size(site, capsys):
    code = main(["config", "show", "tiny", "parallel.tensor_parallel=2", "--world-size", "3"])
    assert code == EXIT_CONFIG_ERROR
    assert "world size 3 is not divisible by tp=2" in capsys.readouterr().err
    assert main(["config", "show", "tiny", "parallel.tensor_parallel=2", "--world-size", "4"]) == 0
    # Overrides may also follow the options.
    assert main(["config", "show", "tiny", "--world-size", "3", "parallel.tensor_parallel=2"]) == 2
    with pytest.raises(SystemExit):
        main(["config", "show", "tiny", "--bogus"])


def test_console_script_exit_code_and_no_traceback(site):
    script = Path(sys.executable).with_name("longboat")
    cmd = (
        [str(script)]
        if script.exists()
        else [
            sys.executable,
            "-c",
            "import sys; from longboat.core.cli import main; sys.exit(main())",
        ]
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    env.pop("WORLD_SIZE", None)
    bad = subprocess.run(
        [*cmd, "config", "show", "tiny", "train.stepz=3"], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2
    assert "train.stepz=3: unknown key" in bad.stderr and "'train.steps'" in bad.stderr
    assert "Traceback" not in bad.stderr
    good = subprocess.run(
        [*cmd, "config", "show", "experiment=tiny"], capture_output=True, text=True, env=env
    )
    assert good.returncode == 0, good.stderr
    assert OmegaConf.create(good.stdout).train.global_batch_size == 8


def test_stack_main_train_gets_validated_config(site, capsys):
    calls = []

    def train(cfg):
        calls.append(cfg)
        return 0

    assert stack_main("fake", ["train", "tiny", "train.steps=3"], train=train) == 0
    assert len(calls) == 1 and calls[0].train.steps == 3 and calls[0].stack == "fake"
    # Bad config: the error is reported and train never runs (validation before heavy init).
    assert stack_main("fake", ["train", "tiny", "train.global_batch_size=7"], train=train) == 2
    assert len(calls) == 1
    assert (
        "train.global_batch_size=7: is not divisible by micro_batch_size=2"
        in capsys.readouterr().err
    )


def test_stack_main_returns_train_exit_code_and_uses_world_size(site, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert stack_main("fake", ["train", "tiny"], train=lambda cfg: 5) == 5
    assert (
        stack_main("fake", ["train", "tiny", "parallel.tensor_parallel=4"], train=lambda c: 0) == 2
    )


def test_stack_main_config_show_and_extra_commands(site, capsys):
    assert stack_main("fake", ["config", "show", "tiny"]) == 0
    assert OmegaConf.create(capsys.readouterr().out).stack == "fake"
    got = []
    commands = {"convert": ("convert checkpoints", lambda argv: got.append(argv) or 7)}
    assert stack_main("fake", ["convert", "--to", "hf", "x"], commands=commands) == 7
    assert got == [["--to", "hf", "x"]]


def test_stack_main_for_an_uninstalled_stack(site, capsys):
    assert stack_main("fak", ["config", "list"]) == 2
    assert "stack='fak': no such stack is installed" in capsys.readouterr().err


def test_umbrella_train_needs_a_train_function(site, capsys):
    assert main(["train", "tiny"]) == 2
    assert "stack 'fake' has no train function" in capsys.readouterr().err


def test_demo_without_the_demo_module_says_so(monkeypatch, capsys):
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(
        cli.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "longboat.core.demo" else real(name, *a),
    )
    assert main(["demo"]) == 1
    assert "longboat.core.demo" in capsys.readouterr().err


def test_cfg_job_prints_the_resolved_config_without_training(site, capsys):
    calls = []
    code = stack_main("fake", ["train", "tiny", "--cfg", "job", "optim.lr=0.5"], train=calls.append)
    assert code == 0 and calls == []
    shown = OmegaConf.create(capsys.readouterr().out)
    assert shown.optim.lr == 0.5 and shown.experiment == "tiny"
    assert stack_main("fake", ["train", "tiny", "--cfg", "hydra"], train=calls.append) == 2
    assert "--cfg job" in capsys.readouterr().err


def test_multirun_runs_each_job_in_its_own_output_dir(site, capsys):
    seen = []
    code = stack_main(
        "fake",
        ["train", "tiny", "-m", "optim.lr=0.1,0.2", "train.steps=3,4", "output_dir=/tmp/sweep"],
        train=lambda cfg: seen.append((cfg.optim.lr, cfg.train.steps, cfg.checkpoint.dir)),
    )
    assert code == 0
    assert [(lr, steps) for lr, steps, _ in seen] == [(0.1, 3), (0.1, 4), (0.2, 3), (0.2, 4)]
    dirs = [d for _, _, d in seen]
    assert dirs[0] == "/tmp/sweep/multirun/0_optim.lr-0.1_train.steps-3/checkpoints"
    assert len(set(dirs)) == 4
    out = capsys.readouterr().out
    assert "sweep job 1/4: optim.lr=0.1 train.steps=3" in out
    # Without -m a sweep is an error that names the flag; a failing job stops the sweep.
    assert stack_main("fake", ["train", "tiny", "optim.lr=0.1,0.2"], train=seen.append) == 2
    assert "add -m (--multirun)" in capsys.readouterr().err
    codes = iter([0, 3, 0])
    ran = []
    code = stack_main(
        "fake",
        ["train", "tiny", "-m", "train.steps=1,2,3"],
        train=lambda cfg: ran.append(cfg.train.steps) or next(codes),
    )
    assert (code, ran) == (3, [1, 2])


def test_multirun_refuses_jobs_that_would_share_a_checkpoint_dir(site, capsys):
    code = stack_main(
        "fake",
        ["train", "tiny", "-m", "optim.lr=0.1,0.2", "checkpoint.dir=/tmp/one"],
        train=lambda cfg: 0,
    )
    assert code == 2
    assert "checkpoint.dir='/tmp/one': sweep jobs 1 and 2 would share it" in capsys.readouterr().err


def test_warnings_print_when_they_happen_once_each(site, capsys):
    import warnings

    seen_during = []

    def train(cfg):
        warnings.warn("first thing", stacklevel=1)
        warnings.warn("first thing", stacklevel=1)  # the same message: printed once
        seen_during.append(capsys.readouterr().err)  # before train returns
        return 0

    assert stack_main("fake", ["train", "tiny"], train=train) == 0
    assert seen_during == ["longboat-fake: warning: first thing\n"]


def test_user_errors_exit_with_their_code_and_debug_shows_the_traceback(site, capsys):
    from longboat.core.checkpoint import CheckpointError

    def train(cfg):
        raise CheckpointError("checkpoint /x is damaged. Fix: checkpoint.resume=/y")

    assert stack_main("fake", ["train", "tiny"], train=train) == 2
    err = capsys.readouterr().err
    assert err == "longboat-fake: error: checkpoint /x is damaged. Fix: checkpoint.resume=/y\n"
    with pytest.raises(CheckpointError):
        stack_main("fake", ["train", "tiny", "--debug"], train=train)


def test_other_ranks_stay_quiet_on_user_errors(site, capsys, monkeypatch):
    from longboat.core.checkpoint import CheckpointError

    def train(cfg):
        raise CheckpointError("damaged")

    monkeypatch.setenv("RANK", "1")
    assert stack_main("fake", ["train", "tiny"], train=train) == 2
    assert capsys.readouterr().err == ""


def test_models_lists_every_installed_stacks_model_options(site, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "core:\n  model=mlp  mlp tiny" in out
    assert "fake:\n  model=gpt  gpt -" in out
    assert stack_main("fake", ["models"]) == 0
    assert capsys.readouterr().out == "fake:\n  model=gpt  gpt -\n"
