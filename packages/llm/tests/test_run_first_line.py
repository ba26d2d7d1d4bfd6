"""A run says what it is doing before it loads its modules (megatron-core, transformers:
seconds of silence otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import importlib.abc, sys
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ("megatron", "longboat.llm.train.training"):
            print("IMPORT", name, flush=True)
        return None
from longboat.core.config.compose import compose_experiment
from longboat.llm.stack import STACK
cfg = compose_experiment("sft", [f"model.init_from={sys.argv[1]}", "data.paths=[missing.jsonl]"],
                         stack="llm", world_size=1)
fn = STACK.resolve_train()
heavy = {"megatron", "longboat.llm.train.training"} & set(sys.modules)
print("LOADED" if heavy else "RESOLVED", flush=True)
sys.meta_path.insert(0, Watch())
try:
    fn(cfg)
except Exception as exc:
    print("STOPPED", type(exc).__name__, flush=True)
"""


def test_the_first_line_comes_before_megatron_loads(tmp_path: Path) -> None:
    from llm_testkit import make_hf_dir

    ckpt = make_hf_dir("qwen3", tmp_path / "ckpt")
    script = tmp_path / "first_line.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "LONGBOAT_ACCELERATOR": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(script), str(ckpt)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines[0] == "RESOLVED", done.stdout + done.stderr[-2000:]
    assert lines[1] == (
        "Building the run (sft, data=prepared): loading megatron-core and transformers, then "
        "the data and the model ..."
    )
    assert lines[2] == "IMPORT longboat.llm.train.training"  # megatron-core's users
    assert lines[-1] == "STOPPED ConfigError"
