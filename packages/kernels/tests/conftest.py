"""Shared fixtures of the kernel tests.

``run_checks``: the ``test_*.py`` wrappers run a ``*_checks.py`` file of this folder in a
subprocess pytest; on CPU it sets ``TRITON_INTERPRET=1`` before triton is imported, which
cannot be done inside this already-running interpreter, on CUDA it runs the compiled kernels.

``skipped_step_check`` and ``graph_replay_check``: checks of the AdamW checks files shared by
the fp32 and the split master storage (the replay check only where
``LONGBOAT_KERNEL_TEST_DEVICE=cuda``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
REPO = Path(__file__).resolve().parents[3]
# device -> (TRITON_INTERPRET, timeout in seconds)
_RUNS = {"cpu": ("1", 300), "cuda": ("0", 600)}


def _run_checks_file(name: str, device: str) -> None:
    """Run ``name`` (a checks file of this folder) on ``device`` ("cpu": Triton's
    interpreter, skipped without triton; "cuda"); fails unless every check ran and passed."""
    interpret, timeout = _RUNS[device]
    if device == "cpu":
        pytest.importorskip("triton")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "2",
        "TRITON_INTERPRET": interpret,
        "LONGBOAT_KERNEL_TEST_DEVICE": device,
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / name)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"{name} failed ({' '.join(cmd)}):\n{tail}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], tail


@pytest.fixture
def run_checks() -> Callable[[str, str], None]:
    return _run_checks_file


def _check_skipped_step(
    call: Callable[..., None],
    state: dict[str, torch.Tensor],
    good: torch.Tensor,
    impl: str,
    updated: str,
) -> None:
    """``call(state, grad, impl, lr=, step=, grad_scale=, found_inf=)`` (an in-place AdamW
    step of the buffers in ``state``) with ``found_inf`` 1 leaves every buffer bit for bit
    unchanged, even with a NaN and an inf in the grads; with ``found_inf`` 0 afterwards it
    updates ``state[updated]`` again."""

    def scalar(value: float) -> torch.Tensor:
        return torch.tensor(value, device=good.device)

    scalars = {"lr": scalar(1e-2), "step": scalar(1.0), "grad_scale": scalar(2.0)}
    call(state, good, impl, found_inf=scalar(0.0), **scalars)  # non-zero moments
    before = {k: v.clone() for k, v in state.items()}
    bad = good.clone()
    bad[5], bad[-1] = float("nan"), float("inf")
    scalars["step"].fill_(2.0)
    call(state, bad, impl, found_inf=scalar(1.0), **scalars)
    for key, value in state.items():
        assert torch.equal(value, before[key]), f"{impl}: {key} changed on a skipped step"
    call(state, good, impl, found_inf=scalar(0.0), **scalars)
    assert not torch.equal(state[updated], before[updated]), f"{impl}: no update after"


@pytest.fixture
def skipped_step_check() -> Callable[..., None]:
    return _check_skipped_step


def _check_graph_replay(
    call: Callable[..., None],
    graphed: dict[str, torch.Tensor],
    eager: dict[str, torch.Tensor],
    grad: torch.Tensor,
) -> None:
    """``call(state, grad, impl, lr=, step=, found_inf=)`` (an in-place AdamW step of the
    buffers in ``state``) captured once on ``graphed``, replayed with new lr / step /
    found_inf values: after each replay ``graphed`` equals, bit for bit, ``eager`` (the same
    start) stepped by the eager Triton call with the same values (no Python number frozen
    into the graph)."""

    def scalar(value: float) -> torch.Tensor:
        return torch.tensor(value, device=grad.device)

    lr, step, found_inf = scalar(1e-2), scalar(1.0), scalar(0.0)
    warm = {k: v.clone() for k, v in graphed.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernel outside the capture
        call(warm, grad, "triton", lr=lr, step=step, found_inf=found_inf)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(graphed, grad, "triton", lr=lr, step=step, found_inf=found_inf)
    for i, (lr_i, inf_i) in enumerate([(1e-2, 0.0), (3e-2, 1.0), (2e-2, 0.0)]):
        lr.fill_(lr_i)
        step.fill_(i + 1.0)
        found_inf.fill_(inf_i)
        graph.replay()
        scalars = {"lr": scalar(lr_i), "step": scalar(i + 1.0), "found_inf": scalar(inf_i)}
        call(eager, grad, "triton", **scalars)
        for key in eager:
            assert torch.equal(graphed[key], eager[key]), f"replay {i}: {key}"


@pytest.fixture
def graph_replay_check() -> Callable[..., None]:
    return _check_graph_replay
