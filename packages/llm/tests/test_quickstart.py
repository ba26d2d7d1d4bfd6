"""The quickstart: corpus from shipped files, and (slow) the whole command twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from longboat.llm.quickstart.corpus import build_corpus, shipped_files


def test_corpus_comes_from_the_installed_packages_and_is_deterministic() -> None:
    files = shipped_files()
    names = {p.as_posix().split("/longboat/", 1)[-1] for p in files}
    assert "llm/quickstart/corpus.py" in names  # this very file's package ships its sources
    assert any(n.endswith(".yaml") for n in names)
    docs = build_corpus(200_000)
    assert docs == build_corpus(200_000)
    assert 150_000 <= sum(map(len, docs)) <= 200_000
    assert max(map(len, docs)) < 20_000 and all(d.strip() for d in docs)


@pytest.mark.slow
def test_quickstart_command_runs_twice(tmp_path: Path) -> None:
    """`longboat-llm train experiment=quickstart` (shortened), then again: it resumes."""
    cmd = [
        sys.executable,
        "-m",
        "longboat.llm.cli",
        "train",
        "experiment=quickstart",
        "train.steps=60",
        "train.eval_every=30",
        "checkpoint.every_steps=30",
        "llm.generate_tokens=8",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout
    assert "starting fresh" in out and "Held-out loss" in out and "Greedy generation" in out
    held = out.split("Held-out loss:")[1].split()
    start, end = float(held[0]), float(held[2])
    assert end < start - 1.0, f"held-out loss {start} -> {end}"
    hf = tmp_path / "outputs" / "quickstart" / "hf"
    assert (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file()
    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Resumed" in second.stdout and "nothing to train" in second.stdout
