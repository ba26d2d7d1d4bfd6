"""``DiffusionTrainStep``'s gradient buffer: in bf16 where a step's gradients land once (one
micro-batch, no reduction between ranks), with exactly the update an fp32 buffer gives.

Two tiny bf16 Wan models with equal weights take two steps on the same batch, one with the
bf16 buffer (one micro-batch a step) and one with megatron's fp32 buffer (built for two
micro-batches, given one); their losses, grad norms and updated weights must be identical.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs longboat-diffusion's megatron backend")

from diffusion_testkit import randn, tensor_parallel_state

from longboat.core.distributed import run_multiprocess


def _worker(rank: int, world: int) -> dict[str, Any]:
    from longboat.core.config.schema import OptimConfig
    from longboat.diffusion.models.wan.config import flavor
    from longboat.diffusion.models.wan.model import build
    from longboat.diffusion.objective.flow_matching import FlowMatchingConfig
    from longboat.diffusion.train.step import DiffusionTrainStep

    cfg = flavor("tiny")
    batch = {
        "latents": randn(1, cfg.in_channels, 3, 8, 8, seed=1),
        "text_embeds": randn(1, 6, cfg.text_dim, seed=2),
        "text_mask": torch.ones(1, 6, dtype=torch.bool),
        "captions": ["a red square"],
    }
    out: dict[str, Any] = {}
    with tensor_parallel_state(1):
        first = build(cfg, precision="bf16")
        state = {k: v.detach().clone() for k, v in first.named_parameters()}
        for name, microbatches in (("bf16", 1), ("fp32", 2)):
            model = first if name == "bf16" else build(cfg, precision="bf16")
            with torch.no_grad():
                for k, v in model.named_parameters():
                    v.copy_(state[k])
            step = DiffusionTrainStep(
                model, OptimConfig(lr=1e-2), precision="bf16", objective=FlowMatchingConfig(),
                seed=0, device=torch.device("cpu"), microbatches=microbatches,
            )  # fmt: skip
            for i in range(2):  # the zero-initialised output projection moves first
                loss = step.forward_backward(i, [batch])
                norm = step.update()
            buffers = {b.grad_data.dtype for b in step.ddp.buffers}
            out[name] = {
                "single": step.single_pass_grads,
                "buffers": buffers,
                "loss": float(loss),
                "norm": float(norm),
                "weights": {k: v.detach().clone() for k, v in model.named_parameters()},
            }
    out["start"] = state
    out["dtypes"] = {k: v.dtype for k, v in state.items()}
    return out


@pytest.mark.multiprocess
def test_bf16_grad_buffer_gives_the_fp32_buffers_update() -> None:
    (out,) = run_multiprocess(_worker, 1)
    bf16, fp32 = out["bf16"], out["fp32"]
    # bf16 parameters' gradients in bf16; the fp32 ones (tables, norms) keep fp32 gradients
    assert bf16["single"] and bf16["buffers"] == {torch.bfloat16, torch.float32}
    assert not fp32["single"] and fp32["buffers"] == {torch.float32}
    assert bf16["loss"] == fp32["loss"] and bf16["norm"] == fp32["norm"] > 0
    # the modulation tables and norm weights stay fp32 in a bf16 model, everything else bf16
    from longboat.diffusion.models.wan.block import FP32_PARAMETERS

    kept = {k for k, d in out["dtypes"].items() if d == torch.float32}
    assert kept and all(any(p in k.split(".") for p in FP32_PARAMETERS) for k in kept), kept
    assert {d for k, d in out["dtypes"].items() if k not in kept} == {torch.bfloat16}
    assert any(k.endswith("q_norm.weight") for k in kept)
    assert any(k.startswith("blocks.") and k.endswith("scale_shift_table") for k in kept)
    moved = 0
    for name, w in bf16["weights"].items():
        assert torch.equal(w, fp32["weights"][name]), name
        moved += not torch.equal(w, out["start"][name])
    assert moved > len(bf16["weights"]) // 2  # the step really updated the weights


def test_a_batch_with_an_empty_caption_is_refused_on_the_host() -> None:
    # The model skips this check on an accelerator (it would read the mask back mid-step),
    # so the step makes it on the host batch, naming the samples' dataset indices.
    from longboat.diffusion.train.step import model_inputs

    batch = {
        "latents": torch.zeros(2, 4, 1, 2, 2),
        "text_embeds": torch.zeros(2, 3, 8),
        "text_mask": torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool),
        "indices": torch.tensor([7, 9]),
    }
    with pytest.raises(ValueError, match=r"no caption token for the samples at indices \[9\]"):
        model_inputs(batch)
    batch["text_mask"][1, 0] = True
    x0, _, mask, latent_mask = model_inputs(batch)
    assert x0 is batch["latents"] and mask is batch["text_mask"] and latent_mask is None
