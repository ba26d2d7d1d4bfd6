"""The ``longboat-embodied`` console script: config list/show, config errors, torchrun training."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from longboat.embodied.cli import main


def test_config_list_names_both_quickstarts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "list"]) == 0
    out = capsys.readouterr().out
    assert "groot_n1_6_tiny" in out and "pi05_tiny" in out


def test_config_show_applies_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["config", "show", "pi05_tiny", "parallel.strategy=fsdp", "train.steps=7"])
    assert code == 0
    out = capsys.readouterr().out
    assert "strategy: fsdp" in out and "steps: 7" in out and "name: pi05" in out


def test_train_with_bad_override_exits_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["train", "experiment=groot_n1_6_tiny", f"output_dir={tmp_path}", "parallel.strategy=zero3"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "parallel.strategy" in err and "zero3" in err
    assert not any(tmp_path.iterdir())  # failed before generating or building anything


def test_broken_dataset_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "data"
    (root / "meta").mkdir(parents=True)
    (root / "meta" / "info.json").write_text("{}")
    code = main(
        ["train", "experiment=pi05_tiny", f"output_dir={tmp_path / 'run'}", f"data.path={root}"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "info.json: unknown codebase_version" in err and "Traceback" not in err
    assert err.count("\n") == 1
    assert err.startswith("longboat-embodied: error: ")


def _quick(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "experiment=groot_n1_6_tiny",
        f"output_dir={out}",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",
        "logging.progress=false",
        "logging.trackers=[]",
        "data.synthetic.num_episodes=2",
        "data.synthetic.episode_length=12",
        *extra,
    ]


def test_train_again_resumes_announcing_changes_and_resume_none_sets_the_run_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(_quick(out, "train.steps=2")) == 0
    first = capsys.readouterr().out
    assert "starting fresh" in first and "Trained steps 1..2" in first
    assert main(_quick(out, "train.steps=3")) == 0
    again = capsys.readouterr().out
    assert f"Resumed from {out / 'checkpoints' / 'step_00000002'} (step 2)" in again
    assert "train.steps 2 -> 3" in again and "Trained steps 3..3" in again
    assert main(_quick(out, "train.steps=2", "checkpoint.resume=none")) == 0
    fresh = capsys.readouterr().out
    assert "set the previous run aside" in fresh and "Trained steps 1..2" in fresh
    aside = sorted(p.name for p in out.iterdir() if ".set-aside-" in p.name)
    assert [name.split(".")[0] for name in aside] == ["checkpoints"]
    assert any(".set-aside-" in p.name for p in (out / "logs").iterdir())
    assert (out / "export" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_two_processes_hsdp(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    env = dict(os.environ, OMP_NUM_THREADS="1", LONGBOAT_ACCELERATOR="cpu")
    subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "longboat.embodied.cli",
            "train",
            "experiment=pi05_tiny",
            f"output_dir={tmp_path}",
            "train.steps=3",
            "train.micro_batch_size=2",
            "train.global_batch_size=null",  # micro x dp: one micro-batch a step per rank
            "parallel.strategy=hsdp",
            "parallel.data_parallel_replicate=2",
            "logging.progress=false",
            "data.synthetic.num_episodes=2",
            "data.synthetic.episode_length=12",
        ],
        env=env,
        check=True,
        timeout=300,
    )
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["trained_steps"] == 3
    assert (tmp_path / "checkpoints" / "step_00000003").is_dir()
    # Rank 0 wrote the stand-in tokenizer the other rank read; both exports ship it.
    for folder in (tmp_path / "export", tmp_path / "export" / "lerobot"):
        assert (folder / "processor.json").is_file()
        assert (folder / "tokenizer" / "tokenizer.json").is_file()
