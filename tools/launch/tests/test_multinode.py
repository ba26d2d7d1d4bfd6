"""Two simulated nodes on localhost train exactly like one node of four (torchrun, c10d, gloo).

Each stack's ``train`` command runs once under one torchrun agent with four workers, and
once under two agents of two workers each that meet through c10d rendezvous (``--nnodes 2``,
the way ``tools/launch/train.sbatch`` launches on Slurm). Same world size, same ranks, same
data: every step's loss must be equal, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", LONGBOAT_ACCELERATOR="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _launch(module: str, args: list[str], *, nodes: int, per_node: int) -> None:
    """``torchrun`` agents on localhost (one per simulated node), all waited for."""
    port = _free_port()
    agents = []
    for node in range(nodes):
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        rdzv += ["--rdzv-id", f"test-{port}", "--rdzv-conf", f"is_host={int(node == 0)}"]
        cmd = [TORCHRUN, "--nnodes", str(nodes), "--nproc-per-node", str(per_node), *rdzv]
        cmd += ["-m", module, "train", *args]
        agents.append(
            subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outputs = [agent.communicate(timeout=900)[0].decode(errors="replace") for agent in agents]
    for agent, out in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, out[-4000:]


def _losses(run_dir: Path, run_name: str) -> dict[int, float]:
    rows = (run_dir / "logs" / run_name / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, rows) if "loss" in r}


def _two_nodes_equal_one(tmp_path: Path, module: str, args: list[str], run_name: str) -> None:
    one, two = tmp_path / "one_node", tmp_path / "two_nodes"
    _launch(module, [*args, f"output_dir={one}"], nodes=1, per_node=4)
    _launch(module, [*args, f"output_dir={two}"], nodes=2, per_node=2)
    ref = _losses(one, run_name)
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert _losses(two, run_name) == ref


COMMON = [
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "logging.progress=false",
    "logging.trackers=[]",
    "checkpoint.save_on_exit=false",
]


def test_llm_two_nodes_of_two_train_like_one_node_of_four(tmp_path: Path) -> None:
    args = [
        "experiment=quickstart",
        "model=llama3_tiny",
        "data=synthetic",
        "data.seq_len=32",
        "data.num_documents=64",
        "export.enabled=false",
        "llm.generate_prompt=null",
        *COMMON,
    ]
    _two_nodes_equal_one(tmp_path, "longboat.llm.cli", args, "quickstart")


def test_embodied_two_nodes_of_two_train_like_one_node_of_four(tmp_path: Path) -> None:
    args = [
        "experiment=groot_n1_6_tiny",
        "data.synthetic.num_episodes=2",
        "data.synthetic.episode_length=12",
        "export.enabled=false",
        *COMMON,
    ]
    _two_nodes_equal_one(tmp_path, "longboat.embodied.cli", args, "groot_n1_6_tiny")
