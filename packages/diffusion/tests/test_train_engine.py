"""The diffusion step on core's megatron step engine (``longboat.core.megatron.engine``).

On CPU the engine gives the diffusion stack the lagged NaN gate (the skip decided on the
device, the verdict resolved one step late) and the synchronous gate's losses; on CUDA it
selects the CUDA-graph step, whose losses follow the eager step's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import longboat.diffusion.models.wan.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.distributed import run_multiprocess

STEPS = 4
GRAPH_STEPS = 7  # 3 eager warm-up steps, the capture, 3 replays
GRAPH_TOL = 1e-5  # relative: the graphed step's LR is an fp32 device table, eager's a float
GRAPH_TOL_CUDA = 1e-4  # relative, fp32 on CUDA: the same, and kernels picked per capture


def _overrides(tmp: Path, *extra: str) -> list[str]:
    """The quickstart shrunk to seconds (one latent shape: the micro-batches stack)."""
    return [
        f"output_dir={tmp / 'out'}",
        f"data.out_dir={tmp / 'data'}",
        "data.num_samples=16",
        "data.num_eval_samples=4",
        "data.shapes=[[1,4,4]]",
        "model.overrides.num_layers=2",
        "model.overrides.num_attention_heads=2",
        "model.overrides.ffn_dim=64",
        "train.micro_batch_size=4",
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "optim.lr=1e-2",
        "optim.grad_clip=0.0",
        "optim.schedule.warmup_steps=2",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.save_on_exit=false",
        "export.enabled=false",
        "diffusion.preview=false",
        *extra,
    ]


def _steps_worker(
    rank: int, world: int, overrides: list[str], sync: bool, steps: int = STEPS
) -> dict[str, Any]:
    """``STEPS`` trainer steps through the gate the engine picks (``sync``: the synchronous
    gate instead, the reference): the gate, the pending verdicts after each step, the
    losses."""
    from longboat.core.config.compose import compose_experiment
    from longboat.core.loop.nan_guard import NaNGuard
    from longboat.core.train import typed_config
    from longboat.core.train.gate import UpdateGate
    from longboat.core.train.schedule import RunSchedule
    from longboat.diffusion.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="diffusion"))
    training = build_training(cfg)
    try:
        guard = NaNGuard(cfg.train.nan_guard)
        schedule = RunSchedule(training.optimizers(), cfg.optim.schedule, cfg.train.steps)
        gate = UpdateGate(guard, schedule) if sync else training.make_gate(guard, schedule)
        batches = training.batches(0)
        losses, pending, resolved = [], [], []
        for step in range(steps):
            out = training.step(step, next(batches), gate)
            pending.append(list(getattr(gate, "pending", [])))
            resolved.append(None if gate.last is None else gate.last.step)
            gate.end_step()
            losses.append(out.loss)
        hazards = []
        if training.step_fn.graph_step is not None:  # what a CUDA capture would reject
            from longboat.core.loop.capture_check import find_capture_hazards

            inputs = training.step_fn.graph_inputs(steps, next(batches))
            found = find_capture_hazards(training.step_fn.graph_step._step, inputs)
            hazards = [f"{h.why} at {h.where}" for h in found]
        gate.flush()
        gate.close()
        return {
            "hazards": hazards,
            "gate": type(gate).__name__,
            "lagged": gate.lagged,
            "graphed": training.step_fn.graph_step is not None,
            "one_pass": training.step_fn.one_pass is not None,
            "captured": training.step_fn.graph_step is not None
            and training.step_fn.graph_step.graph.active,
            "pending": pending,
            "resolved": resolved,
            "losses": [float(v) for v in losses],
            "updates": schedule.position,
            "describe": training.describe(),
        }
    finally:
        training.close()


@pytest.mark.multiprocess
def test_the_engine_picks_the_lagged_gate_with_the_synchronous_losses(tmp_path: Path) -> None:
    over = _overrides(tmp_path)
    lagged = run_multiprocess(_steps_worker, 1, over, False, timeout=400)[0]
    # The reference is the step as it was: megatron's update under the synchronous gate.
    before = [*over, "optim.one_pass_adamw=false"]
    sync = run_multiprocess(_steps_worker, 1, before, True, timeout=400)[0]
    assert lagged["gate"] == "LaggedLossGuard" and lagged["lagged"], lagged
    assert lagged["one_pass"] and not sync["one_pass"]
    assert not lagged["graphed"]
    # After step n's allow, step n is staged and only step n-1's verdict is known.
    assert lagged["pending"] == [[n] for n in range(STEPS)], lagged
    assert lagged["resolved"] == [None, *range(STEPS - 1)], lagged
    assert lagged["updates"] == sync["updates"] == STEPS
    assert sync["gate"] == "UpdateGate" and sync["pending"] == [[]] * STEPS
    # The same first loss; then the one-pass update (lagged) vs torch's foreach AdamW (sync):
    # one update rule, float rounding only.
    assert lagged["losses"][0] == sync["losses"][0]
    for a, b in zip(lagged["losses"], sync["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (lagged["losses"], sync["losses"])
    assert any("train.cuda_graph: eager steps" in line for line in lagged["describe"])


@pytest.mark.multiprocess
def test_the_graphed_step_gives_the_eager_losses_on_cpu(tmp_path: Path) -> None:
    """train.cuda_graph=true on CPU: the engine's graphed step (noise drawn on the host as its
    inputs, the LR from a device table) runs eagerly and trains as the eager step does."""
    over = _overrides(tmp_path)
    graphed = run_multiprocess(
        _steps_worker, 1, [*over, "train.cuda_graph=true"], False, timeout=400
    )[0]
    eager = run_multiprocess(_steps_worker, 1, [*over, "train.cuda_graph=false"], False)[0]
    assert graphed["graphed"] and not graphed["captured"] and graphed["lagged"], graphed
    assert not eager["graphed"] and eager["gate"] == "LaggedLossGuard"
    assert graphed["resolved"] == eager["resolved"] == [None, *range(STEPS - 1)]
    assert graphed["losses"][0] == eager["losses"][0]
    for a, b in zip(graphed["losses"], eager["losses"], strict=True):
        assert abs(a - b) <= GRAPH_TOL * abs(b), (graphed["losses"], eager["losses"])
    assert graphed["losses"][-1] < graphed["losses"][0]
    # Nothing in the step reads the device on the host or copies Python data to it, but the
    # model's check of a CPU text mask (on CUDA the step checks the batch before the copy).
    assert [h for h in graphed["hazards"] if "empty_captions" not in h] == [], graphed


def test_a_step_whose_shapes_change_is_not_graphed(tmp_path: Path) -> None:
    """Several latent shapes: the engine names why the step runs eagerly, and
    train.cuda_graph=true is refused (exit-2 ConfigError) naming the key."""
    over = _overrides(tmp_path, "data.num_samples=32", "data.shapes=[[1,4,4],[3,4,4]]")
    auto = run_multiprocess(_steps_worker, 1, over, False, 1, timeout=400)[0]
    assert not auto["graphed"] and auto["gate"] == "LaggedLossGuard"
    # On CPU the first reason is the accelerator's; on CUDA the shapes'.
    why = "2 latent shapes" if torch.cuda.is_available() else "cpu accelerator has no CUDA graphs"
    assert any("train.cuda_graph: eager steps (" in line and why in line
               for line in auto["describe"]), auto["describe"]  # fmt: skip
    with pytest.raises(Exception, match=r"train\.cuda_graph.*2 latent shapes"):
        run_multiprocess(_steps_worker, 1, [*over, "train.cuda_graph=true"], False, 1)


@pytest.mark.gpu
def test_the_cuda_graph_step_is_selected_on_cuda_and_matches_eager(tmp_path: Path) -> None:
    """On CUDA the engine captures the diffusion step by default (train.cuda_graph=null); its
    losses over 3 replays follow the eager step's within GRAPH_TOL_CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    over = _overrides(tmp_path, "train.precision=fp32", f"train.steps={GRAPH_STEPS}")
    kw = {"backend": "nccl", "start_method": "spawn", "timeout": 400}
    graphed = run_multiprocess(_steps_worker, 1, over, False, GRAPH_STEPS, **kw)[0]
    eager = run_multiprocess(
        _steps_worker, 1, [*over, "train.cuda_graph=false"], False, GRAPH_STEPS, **kw
    )[0]
    assert graphed["graphed"] and graphed["captured"], graphed["describe"]
    assert not eager["graphed"]
    for a, b in zip(graphed["losses"], eager["losses"], strict=True):
        assert abs(a - b) <= GRAPH_TOL_CUDA * abs(b), (graphed["losses"], eager["losses"])
