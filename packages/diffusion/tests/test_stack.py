"""The diffusion stack registers with core and its console script answers."""

from __future__ import annotations

from longboat.core.stack import discover_stacks
from longboat.diffusion.cli import main


def test_stack_is_discovered_through_its_entry_point() -> None:
    stacks = discover_stacks()
    assert "diffusion" in stacks
    assert stacks["diffusion"].console_script == "longboat-diffusion"


def test_help_exits_zero(capsys) -> None:
    try:
        code = main(["--help"])
    except SystemExit as exc:
        code = exc.code
    assert code == 0
    assert "longboat-diffusion" in capsys.readouterr().out
