"""Data and context parallel training equal one process (gloo, CPU, fp32, tiny Wan).

At the same global batch of 8 samples, DP=2 (one micro-batch of 4 per rank) and CP=2 (every
rank all 8 samples, half of each sample's tokens) train the per-step losses and held-out
losses of one process taking two micro-batches of 4, within 1e-5: megatron's DDP and
distributed optimizer, the step's sample-mean loss, the per-micro-batch noise seeds and the
CP gradient scaling line up. CP=2 also with packed micro-batches of mixed shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import longboat.diffusion.models.wan.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.distributed import run_multiprocess

PARALLEL_TOL = 1e-5
STEPS = 3


def _overrides(out: Path, data: Path, extra: list[str]) -> list[str]:
    return [
        f"output_dir={out}",
        f"data.out_dir={data}",
        "data.num_samples=32",
        "data.num_eval_samples=8",
        "data.shapes=[[1,5,5],[3,4,6]]",  # 25 tokens: odd, so CP pads one token
        "model.overrides.num_layers=2",
        "model.overrides.num_attention_heads=2",
        "model.overrides.attention_head_dim=16",
        "model.overrides.ffn_dim=64",
        "model.overrides.patch_size=[1,1,1]",  # one token per cell: the odd count above
        "data.patch_size=[1,1,1]",
        "train.micro_batch_size=4",
        "train.global_batch_size=8",
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "train.log_every=1",
        "optim.lr=1e-2",  # large steps, so a mismatch in the updates shows in the losses
        "optim.schedule.warmup_steps=0",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.every_steps=0",
        "checkpoint.save_on_exit=false",
        "export.enabled=false",
        "diffusion.preview=false",
        *extra,
    ]


def _worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import Trainer, typed_config
    from longboat.diffusion.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="diffusion"))
    training = build_training(cfg)
    try:
        result = Trainer(cfg, training).fit()
        return {
            "losses": result.losses,
            "eval": result.eval[STEPS]["eval_loss"],
            "eval_start": result.eval[0]["eval_loss"],
            "describe": training.describe()[0],
            "accumulation": training.accumulation,
        }
    finally:
        training.close()


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < PARALLEL_TOL for x, y in zip(a, b))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parallel_data")


@pytest.fixture(scope="module")
def single(data_dir: Path) -> dict[str, Any]:
    out = run_multiprocess(_worker, 1, _overrides(data_dir / "dp1", data_dir, []), timeout=400)
    return out[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["dp2", "cp2"])
def test_two_ranks_train_the_single_process_losses(
    layout: str, single: dict[str, Any], data_dir: Path
) -> None:
    extra = ["parallel.context_parallel=2"] if layout == "cp2" else []
    outs = run_multiprocess(_worker, 2, _overrides(data_dir / layout, data_dir, extra), timeout=400)
    assert single["accumulation"] == 2
    assert outs[0]["accumulation"] == (1 if layout == "dp2" else 2)
    assert ("cp=2 dp=1" if layout == "cp2" else "cp=1 dp=2") in outs[0]["describe"]
    assert single["eval"] < 0.95 * single["eval_start"]  # the updates moved the model
    for out in outs:
        assert _close(out["losses"], single["losses"]), (out["losses"], single["losses"])
        assert abs(out["eval"] - single["eval"]) < PARALLEL_TOL


@pytest.mark.multiprocess
def test_cp2_equals_cp1_with_packed_micro_batches(data_dir: Path) -> None:
    pack = ["data.batching=pack", "data.max_tokens=100", "train.micro_batch_size=1",
            "train.global_batch_size=2"]  # fmt: skip
    one = run_multiprocess(_worker, 1, _overrides(data_dir / "pack1", data_dir, pack), timeout=400)
    two = run_multiprocess(
        _worker,
        2,
        _overrides(data_dir / "pack_cp2", data_dir, [*pack, "parallel.context_parallel=2"]),
        timeout=400,
    )
    for out in two:
        assert _close(out["losses"], one[0]["losses"]), (out["losses"], one[0]["losses"])
        assert abs(out["eval"] - one[0]["eval"]) < PARALLEL_TOL
