"""The diffusion stack on CUDA: a bf16 Wan block stack with recompute keeps the self-attention
kernels' outputs (no attention kernel in the backward; the one the GPU's SDPA picks must be
recognised), with the loss and gradients of no recompute."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs longboat-diffusion's megatron backend")

from longboat.core.distributed import run_multiprocess

GRAD_TOL = 2e-2  # bf16: max abs difference relative to the largest gradient of the tensor


def _worker(rank: int, world: int, device: str) -> dict[str, object]:
    sys.path.insert(0, str(Path(__file__).parent))  # a spawned child: diffusion_testkit
    from diffusion_testkit import loss_and_grads, randn

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.diffusion.models.wan.config import flavor
    from longboat.diffusion.models.wan.model import build

    parallel_state.initialize(ParallelConfig(), get_accelerator(device), seed=1)
    try:
        cfg = flavor("tiny").replace(num_layers=3, num_attention_heads=4, attention_head_dim=64)
        model = build(cfg, precision="bf16").to(device)
        lat = randn(1, cfg.in_channels, 5, 32, 32, seed=1).to(device)
        text = randn(1, 16, cfg.text_dim, seed=2).to(device)
        mask = torch.ones(1, 16, dtype=torch.bool, device=device)
        ts = torch.tensor([500.0], device=device)
        target = model(lat, ts, text, mask).detach().float().normal_()

        def forward() -> torch.Tensor:
            return model(lat, ts, text, mask).float()

        out: dict[str, object] = {"layers": cfg.num_layers}
        for key, blocks, again in (("none", 0, False), ("kept", -1, False), ("full", -1, True)):
            loss, grads, _, attn = loss_and_grads(
                model, model.blocks[0], forward, target, blocks, recompute_attention=again
            )
            out[key] = (float(loss), {k: v.float().cpu() for k, v in grads.items()}, attn)
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.gpu
def test_recompute_keeps_the_cuda_attention_outputs() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    (out,) = run_multiprocess(_worker, 1, "cuda", backend="nccl", start_method="spawn", timeout=300)
    loss, grads, attn = out["none"]
    assert attn == 0
    assert out["kept"][2] == 0, "a self-attention kernel ran in the backward with outputs kept"
    assert out["full"][2] == out["layers"], out["full"][2]
    for key in ("kept", "full"):
        other_loss, other, _ = out[key]
        assert other_loss == loss  # the forward is the same computation
        for name, g in grads.items():
            rel = (other[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)
            assert rel <= GRAD_TOL, (key, name, float(rel))
