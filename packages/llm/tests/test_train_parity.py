"""`longboat-llm train` at TP=2 and PP=2 follows the TP=1 loss curve (fp32, 10 steps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from longboat.core.distributed import run_multiprocess
from longboat.llm.train.testing import compose, make_tiny_dataset, tiny_overrides

TOL = 1e-4  # fp32: TP / PP only reorder reductions


def _train_worker(rank: int, world: int, overrides: list[str]) -> list[float]:
    from longboat.llm.train.loop import run

    return run(compose(overrides, world_size=world)).losses


@pytest.fixture(scope="module")
def tiny(
    tmp_path_factory: pytest.TempPathFactory, hf_dirs: dict[str, Path]
) -> tuple[Path, Path, Path, str]:
    root = tmp_path_factory.mktemp("tiny")
    data, tok = make_tiny_dataset(root / "data")
    # Start from an HF checkpoint: megatron's random init draws differently per pipeline stage.
    return data, tok, root, f"llm.init_from_hf={hf_dirs['qwen3']}"


@pytest.fixture(scope="module")
def tp1_losses(tiny: tuple[Path, Path, Path, str]) -> list[float]:
    data, tok, root, init = tiny
    (losses,) = run_multiprocess(_train_worker, 1, [*tiny_overrides(data, tok, root / "tp1"), init])
    return losses


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [
        "parallel.tensor_parallel=2",
        "parallel.pipeline_parallel=2",
        "parallel.pipeline_parallel=2,parallel.virtual_pipeline_parallel=2",
        "parallel.data_parallel=2",
    ],
    ids=["tp2", "pp2", "pp2_vpp2", "dp2"],  # dp2: the same microbatches, split over ranks
)
def test_losses_match_tp1(layout: str, tiny: tuple[Path, Path, Path, str], tp1_losses) -> None:
    data, tok, root, init = tiny
    settings = layout.split(",")
    out = root / "_".join(x.replace("parallel.", "").replace("=", "") for x in settings)
    overrides = [*tiny_overrides(data, tok, out), init, *settings]
    results = run_multiprocess(_train_worker, 2, overrides)
    assert len(tp1_losses) == 10
    assert tp1_losses[-1] < tp1_losses[0] - 0.5, f"the model did not learn: {tp1_losses}"
    for losses in results:  # every rank reports the step loss
        diffs = [abs(a - b) for a, b in zip(losses, tp1_losses, strict=True)]
        assert max(diffs) <= TOL, f"{layout}: max |loss - loss_tp1| = {max(diffs):.2e}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_recompute_keeps_the_losses(
    mode: str, tiny: tuple[Path, Path, Path, str], tp1_losses
) -> None:
    data, tok, root, init = tiny
    overrides = [*tiny_overrides(data, tok, root / mode), init]
    (losses,) = run_multiprocess(
        _train_worker, 1, [*overrides, f"train.activation_checkpointing={mode}"]
    )
    diffs = [abs(a - b) for a, b in zip(losses, tp1_losses, strict=True)]
    assert max(diffs) <= 1e-5, f"recompute={mode}: max |loss - loss_none| = {max(diffs):.2e}"


@pytest.mark.multiprocess
def test_bf16_training_tracks_fp32(tiny: tuple[Path, Path, Path, str], tp1_losses) -> None:
    data, tok, root, init = tiny
    overrides = [*tiny_overrides(data, tok, root / "bf16"), init, "llm.cpu_precision=bf16"]
    (losses,) = run_multiprocess(_train_worker, 1, overrides)
    diffs = [abs(a - b) for a, b in zip(losses, tp1_losses, strict=True)]
    assert 0 < max(diffs) <= 0.1, f"bf16 vs fp32 losses: max diff {max(diffs):.3f}"
    assert losses[-1] < losses[0] - 0.5
