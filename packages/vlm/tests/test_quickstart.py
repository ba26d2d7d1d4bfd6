"""The README's quickstart, run as written: ``longboat-vlm train experiment=quickstart`` trains
the tiny Qwen2.5-VL from scratch on CPU, and its export answers held-out questions about
images it has not seen (slow: the whole 800-step run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
COMMAND = "uv run longboat-vlm train experiment=quickstart"


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="in 800 steps the tiny model reads colour (40/40) but not shape: 8/20 held-out "
    "answers, held-out loss 0.36",
)
def test_quickstart_learns_to_answer_from_the_image(tmp_path: Path) -> None:
    assert COMMAND in README.read_text(), "the README's quickstart command changed"
    cmd = [sys.executable, "-m", "longboat.vlm.cli", *COMMAND.split()[3:]]
    run = subprocess.run(
        cmd, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=1800
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    held = out.split("Held-out loss:")[1].split()
    start, end = float(held[0]), float(held[2])
    # The language prior alone (the answer's words without looking) sits near 0.5 per token.
    assert end < 0.15, f"held-out loss {start} -> {end}"
    right, asked = map(int, re.search(r"from the export: (\d+)/(\d+)", out).groups())
    assert asked == 20
    assert right >= 18, f"{right}/20 held-out questions answered\n{out[-2000:]}"
    hf = tmp_path / "outputs" / "quickstart_vlm" / "hf"
    assert (hf / "config.json").is_file() and (hf / "generation_config.json").is_file()
