"""``longboat-llm models`` lists this stack's models only, ``--version`` and ``--help`` say
what a new user needs, and showing a config loads no torch (it answers in about a second)."""

from __future__ import annotations

import contextlib
import subprocess
import sys

from longboat.llm.cli import main


def test_models_lists_only_this_stacks_families_and_flavors(capsys) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "llm:"
    assert "model=qwen3_0_6b" in out and "qwen3 0.6b" in out and "qwen3_moe 30b_a3b" in out
    assert "groot" not in out and "pi05" not in out and "mlp" not in out


def test_version_and_help_examples(capsys) -> None:
    import importlib.metadata as md

    try:
        main(["--version"])
    except SystemExit as stop:
        assert stop.code == 0
    out = capsys.readouterr().out
    assert f"longboat-llm {md.version('longboat-llm')}" in out and "longboat-core" in out
    with contextlib.suppress(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "experiment=sft model.init_from=" in out


def test_composing_a_config_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from longboat.core.config.compose import compose_experiment\n"
        "compose_experiment('quickstart', ['model=qwen3_0_6b'], stack='llm')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('megatron')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
