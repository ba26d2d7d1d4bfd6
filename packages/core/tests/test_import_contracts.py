"""The package boundaries are enforced: planting a violation makes import-linter fail.

The contracts live in the root pyproject.toml. Each case copies every package's
source tree into a temp dir, plants one forbidden import and runs
``lint-imports`` against the copy; the contract named in the case must break.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
LINT_IMPORTS = pathlib.Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(
    not (REPO / "pyproject.toml").exists() or not LINT_IMPORTS.exists(),
    reason="needs the source checkout and import-linter (dev group)",
)


def _copy_tree(tmp_path: pathlib.Path) -> pathlib.Path:
    """Merge every package's src/longboat into tmp/src/longboat and copy the contracts."""
    src = tmp_path / "src"
    for pkg_src in sorted((REPO / "packages").glob("*/src/longboat")):
        shutil.copytree(
            pkg_src,
            src / "longboat",
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    root = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts = root["tool"]["importlinter"]
    (tmp_path / ".importlinter.toml").write_text(_dump_importlinter(contracts))
    return src


def _dump_importlinter(cfg: dict) -> str:
    """Write [tool.importlinter] back out as TOML (lists of strings and scalars only)."""

    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return '"' + str(v) + '"'

    lines = ["[tool.importlinter]"]
    lines += [f"{k} = {value(v)}" for k, v in cfg.items() if k != "contracts"]
    for contract in cfg["contracts"]:
        lines.append("[[tool.importlinter.contracts]]")
        lines += [f"{k} = {value(v)}" for k, v in contract.items()]
    return "\n".join(lines) + "\n"


def _lint(tmp_path: pathlib.Path, src: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports on the copy only: the editable installs' src paths are dropped."""
    runner = (
        "import sys\n"
        f"sys.path = [p for p in sys.path if not p.startswith({str(REPO / 'packages')!r})]\n"
        "from importlinter.cli import lint_imports_command\n"
        "sys.argv = ['lint-imports', sys.argv[1], '--no-cache']\n"
        "lint_imports_command()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", runner, str(tmp_path / ".importlinter.toml")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _plant(src: pathlib.Path, module: str, line: str) -> None:
    path = src / pathlib.Path(*module.split("."))
    target = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    target.write_text(target.read_text() + f"\n{line}\n")


def test_clean_tree_passes(tmp_path: pathlib.Path) -> None:
    src = _copy_tree(tmp_path)
    result = _lint(tmp_path, src)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("longboat.core", "import longboat.llm", "core imports no stack"),
        ("longboat.kernels", "import longboat.embodied", "kernels imports only core"),
        ("longboat.llm", "import longboat.embodied", "stacks are independent of one another"),
        ("longboat.vlm", "import longboat.llm", "stacks are independent of one another"),
        ("longboat.core.megatron", "import longboat.vlm", "core imports no stack"),
        ("longboat.diffusion", "import longboat.vlm", "stacks are independent of one another"),
        ("longboat.core.megatron", "import longboat.diffusion", "core imports no stack"),
        ("longboat.embodied", "import megatron.core", "embodied never imports megatron"),
        ("longboat.core.config", "import megatron.core", "only longboat.core.megatron may"),
        (
            "longboat.core.engine.torch",
            "import longboat.core.megatron",
            "the torch step engine never imports megatron",
        ),
    ],
)
def test_planted_violation_breaks_contract(
    tmp_path: pathlib.Path, module: str, line: str, contract: str
) -> None:
    src = _copy_tree(tmp_path)
    _plant(src, module, line)
    result = _lint(tmp_path, src)
    assert result.returncode != 0, f"planting `{line}` in {module} went unnoticed"
    broken = [ln for ln in result.stdout.splitlines() if " BROKEN" in ln]
    assert any(contract in ln for ln in broken), result.stdout
