"""The VLM's step on core's megatron step engine (``longboat.core.megatron.engine``).

On CPU the engine gives the VLM the lagged NaN gate (the skip decided on the device, the
verdict resolved one step late) and the same losses as the synchronous gate; on CUDA it
selects the CUDA-graph step, whose losses follow the eager step's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from longboat.core.distributed import run_multiprocess

STEPS = 4


def _overrides(tmp: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={tmp / 'out'}",
        f"data.out_dir={tmp / 'data'}",
        "data.num_train=16",
        "data.num_eval=4",
        "data.seq_len=256",
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "checkpoint.save_on_exit=false",
        "vlm.answer_eval_samples=0",
        "vlm.export_hf=false",
        "optim.grad_clip=0.0",
        *extra,
    ]


def _steps_worker(rank: int, world: int, overrides: list[str], sync: bool) -> dict[str, Any]:
    """``STEPS`` trainer steps through the gate the engine picks (``sync``: the synchronous
    gate instead, the reference): the gate, the pending verdicts after each step, the
    losses."""
    from longboat.core.config.compose import compose_experiment
    from longboat.core.loop.nan_guard import NaNGuard
    from longboat.core.train import typed_config
    from longboat.core.train.gate import UpdateGate
    from longboat.core.train.schedule import RunSchedule
    from longboat.vlm.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="vlm"))
    training = build_training(cfg)
    try:
        guard = NaNGuard(cfg.train.nan_guard)
        schedule = RunSchedule(training.optimizers(), cfg.optim.schedule, cfg.train.steps)
        gate = UpdateGate(guard, schedule) if sync else training.make_gate(guard, schedule)
        batches = training.batches(0)
        losses, pending, resolved = [], [], []
        for step in range(STEPS):
            out = training.step(step, next(batches), gate)
            pending.append(list(getattr(gate, "pending", [])))
            resolved.append(None if gate.last is None else gate.last.step)
            gate.end_step()
            losses.append(out.loss)
        gate.flush()
        gate.close()
        return {
            "gate": type(gate).__name__,
            "lagged": gate.lagged,
            "graphed": training.step_fn.graph_step is not None,
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
    import megatron.core.optimizer  # noqa: F401  (import once; forked processes share it)

    over = _overrides(tmp_path)
    lagged = run_multiprocess(_steps_worker, 1, over, False, timeout=400)[0]
    sync = run_multiprocess(_steps_worker, 1, over, True, timeout=400)[0]
    assert lagged["gate"] == "LaggedLossGuard" and lagged["lagged"], lagged
    assert not lagged["graphed"]
    # After step n's allow, step n is staged and only step n-1's verdict is known.
    assert lagged["pending"] == [[n] for n in range(STEPS)], lagged
    assert lagged["resolved"] == [None, *range(STEPS - 1)], lagged
    assert lagged["updates"] == sync["updates"] == STEPS
    assert sync["gate"] == "UpdateGate" and sync["pending"] == [[]] * STEPS
    # The same first loss; then fused AdamW (lagged) vs foreach (sync): float rounding only.
    assert lagged["losses"][0] == sync["losses"][0]
    for a, b in zip(lagged["losses"], sync["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (lagged["losses"], sync["losses"])
    assert any("train.cuda_graph: eager steps" in line for line in lagged["describe"])
