"""One optimizer step at TP=2 and PP=2 equals the TP=1 step (loss and updated weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longboat.core.distributed import run_multiprocess

LOSS_TOL = 1e-5  # fp32: TP / PP only reorder reductions
WEIGHT_TOL = 1e-5
LR = 1.0  # large on purpose: the update must be far above the tolerance


def _step_worker(
    rank: int, world: int, hf_dir: Path, tokens: torch.Tensor, layout: dict[str, int]
) -> tuple[float | None, dict[str, torch.Tensor]]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.hf_io import gather_hf_state_dict
    from longboat.llm.build import build_model
    from longboat.llm.hf import load_hf, read_hf_config
    from longboat.llm.pipeline import train_step

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(**layout), get_accelerator("cpu"))
    try:
        chunks = build_model(cfg)
        load_hf(chunks, cfg, hf_dir)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        model = [
            DistributedDataParallel(config=c.config, ddp_config=ddp_cfg, module=c) for c in chunks
        ]
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="sgd", lr=LR, weight_decay=0.0, clip_grad=0.0), model
        )
        micro = [
            {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}
            for t in tokens.split(1)
        ]
        loss = train_step(model, opt, micro)
        return loss, gather_hf_state_dict(chunks, cfg.to_arch())
    finally:
        parallel_state.destroy()


def _run(hf_dir: Path, tokens: torch.Tensor, world: int, layout: dict[str, int]):
    outs = run_multiprocess(_step_worker, world, hf_dir, tokens, layout)
    losses = [loss for loss, _ in outs if loss is not None]
    weights: dict[str, torch.Tensor] = {}
    for _, sd in outs:
        weights.update(sd)
    return losses, weights


@pytest.fixture(scope="module")
def tp1_step(hf_dirs: dict[str, Path], tokens: torch.Tensor):
    return _run(hf_dirs["llama3"], tokens, 1, {})


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout", [{"tensor_parallel": 2}, {"pipeline_parallel": 2}], ids=["tp2", "pp2"]
)
def test_train_step_matches_tp1(
    layout: dict[str, int], tp1_step, hf_dirs: dict[str, Path], tokens: torch.Tensor
) -> None:
    from safetensors.torch import load_file

    ref_losses, ref_weights = tp1_step
    losses, weights = _run(hf_dirs["llama3"], tokens, 2, layout)
    assert len(ref_losses) == 1 and losses, "the last stage must report the loss"
    for loss in losses:
        assert abs(loss - ref_losses[0]) <= LOSS_TOL, (loss, ref_losses[0])
    assert ref_losses[0] > 1.0  # a real LM loss (~ln 256 for a random model)
    assert set(weights) == set(ref_weights)
    initial = load_file(str(hf_dirs["llama3"] / "model.safetensors"))
    moved = 0.0
    for name, ref in ref_weights.items():
        diff = (weights[name] - ref).abs().max().item()
        assert diff <= WEIGHT_TOL, f"{name}: max |w_tp - w_tp1| = {diff:.3e}"
        moved = max(moved, (ref - initial[name]).abs().max().item())
    assert moved > 100 * WEIGHT_TOL, "the step did not change the weights"
