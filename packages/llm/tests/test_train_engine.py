"""The LLM's step on core's megatron step engine (``longboat.core.megatron.engine``).

On CPU the engine picks the lagged NaN gate by default (no CUDA graphs: one line says so);
on CUDA it selects the CUDA-graph step by default, whose losses follow the eager step's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from llm_testkit import make_tiny_dataset, tiny_overrides

from longboat.core.distributed import run_multiprocess

STEPS = 7  # 3 eager warm-up steps, the capture, 3 replays
GRAPH_TOL_CUDA = 1e-4  # relative, fp32 on CUDA: an fp32 LR table, kernels picked per capture


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("engine")
    data, tok = make_tiny_dataset(root / "data")
    return data, tok, root


def _overrides(tiny: tuple[Path, Path, Path], name: str, *extra: str) -> list[str]:
    data, tok, root = tiny
    one_micro = ("train.global_batch_size=2", "optim.grad_clip=0.0")  # the graph's conditions
    return [*tiny_overrides(data, tok, root / name, steps=STEPS), *one_micro, *extra]


def _steps_worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    """``STEPS`` trainer steps through the gate the engine picks."""
    from longboat.core.config.compose import compose_experiment
    from longboat.core.loop.nan_guard import NaNGuard
    from longboat.core.train import typed_config
    from longboat.core.train.schedule import RunSchedule
    from longboat.llm.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="llm"))
    training = build_training(cfg)
    try:
        guard = NaNGuard(cfg.train.nan_guard)
        schedule = RunSchedule(training.optimizers(), cfg.optim.schedule, cfg.train.steps)
        gate = training.make_gate(guard, schedule)
        batches = training.batches(0)
        losses = []
        for step in range(STEPS):
            losses.append(training.step(step, next(batches), gate).loss)
            gate.end_step()
        graph = training.step_fn.graph_step
        hazards = []
        if graph is not None:  # what a CUDA capture would reject
            from longboat.core.device.transfer import batch_to_device
            from longboat.core.loop.capture_check import find_capture_hazards

            micro = [batch_to_device(b, training.device) for b in next(batches)]
            found = find_capture_hazards(graph._step, training.step_fn.graph_inputs(STEPS, micro))
            hazards = [f"{h.why} at {h.where}" for h in found]
        gate.flush()
        gate.close()
        return {
            "gate": type(gate).__name__,
            "hazards": hazards,
            "graphed": graph is not None,
            "captured": graph is not None and graph.graph.active,
            "losses": [float(v) for v in losses],
            "describe": training.describe(),
        }
    finally:
        training.close()


@pytest.mark.multiprocess
def test_the_default_on_cpu_is_the_lagged_gate_and_says_why_not_the_graph(tiny) -> None:
    (run,) = run_multiprocess(_steps_worker, 1, _overrides(tiny, "auto"), timeout=400)
    assert run["gate"] == "LaggedLossGuard" and not run["graphed"], run
    notice = "train.cuda_graph: eager steps (the cpu accelerator has no CUDA graphs)."
    assert notice in run["describe"], run["describe"]


@pytest.mark.gpu
def test_the_cuda_graph_step_is_selected_on_cuda_and_matches_eager(tiny) -> None:
    """On CUDA the engine captures the LLM step by default (train.cuda_graph=null); its losses
    over 3 replays follow the eager step's within GRAPH_TOL_CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kw = {"backend": "nccl", "start_method": "spawn", "timeout": 400}
    fp32 = "train.precision=fp32"
    (graphed,) = run_multiprocess(_steps_worker, 1, _overrides(tiny, "g", fp32), **kw)
    (eager,) = run_multiprocess(
        _steps_worker, 1, _overrides(tiny, "e", fp32, "train.cuda_graph=false"), **kw
    )
    assert graphed["graphed"] and graphed["captured"], graphed["describe"]
    assert graphed["gate"] == "_GraphGate" and eager["gate"] == "LaggedLossGuard"
    for a, b in zip(graphed["losses"], eager["losses"], strict=True):
        assert abs(a - b) <= GRAPH_TOL_CUDA * abs(b), (graphed["losses"], eager["losses"])


@pytest.mark.multiprocess
def test_the_graphed_step_has_nothing_a_capture_rejects(tiny) -> None:
    """train.cuda_graph=true on CPU: the engine's graphed step runs (eagerly) and nothing in
    it reads the device on the host, copies Python data to it or reseeds an RNG."""
    over = _overrides(tiny, "forced", "train.cuda_graph=true")
    (run,) = run_multiprocess(_steps_worker, 1, over, timeout=400)
    assert run["graphed"] and not run["captured"] and run["gate"] == "_GraphGate", run
    assert run["hazards"] == [], run["hazards"]


def _describe_worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import typed_config
    from longboat.llm.train.training import build_training

    training = build_training(
        typed_config(compose_experiment("quickstart", overrides, stack="llm"))
    )
    try:
        params = [p for chunk in training.step_fn.chunks for p in chunk.parameters()]
        adapters = [n for chunk in training.step_fn.chunks for n, p in chunk.named_parameters()
                    if p.requires_grad]  # fmt: skip
        return {
            "describe": training.describe(),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "total": sum(p.numel() for p in params),
            "adapters_only": all("lora" in n for n in adapters) and bool(adapters),
        }
    finally:
        training.close()


def test_a_lora_run_says_what_it_trains(tiny: tuple[Path, Path, Path]) -> None:
    overrides = _overrides(tiny, "lora", "lora.enabled=true", "lora.rank=4", "lora.alpha=8")
    (run,) = run_multiprocess(_describe_worker, 1, overrides, timeout=300)
    assert run["adapters_only"]
    # 4 layers x rank 4 x (in + out) of qkv 64->128, proj 64->64, fc1 64->256, fc2 128->64.
    assert run["trainable"] == 4 * 4 * (192 + 128 + 320 + 192)
    share = 100 * run["trainable"] / run["total"]
    want = (
        "LoRA: rank 4, alpha 8 on linear_qkv, linear_proj, linear_fc1, linear_fc2; "
        f"{run['trainable']:,} trainable of {run['total']:,} parameters ({share:.2f}%)."
    )
    assert want in run["describe"], run["describe"]
