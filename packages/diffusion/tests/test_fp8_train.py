"""``train.precision=fp8`` in the diffusion stack: the DiT blocks' linears on longboat's FP8
linear (the llm decoders' wiring), emulated on CPU (dequantise, multiply in fp32; the command
line refuses a device without FP8 matmuls, tested below).

A tiny Wan DiT of 4 blocks (the middle two blocks' 20 linears in FP8; the first and last
blocks, embeddings, modulation and output projection in bf16) takes 5 AdamW steps from the
same weights (the zero-initialised output projection drawn, so that the blocks reach the loss
from the first step) on one batch with bf16 GEMMs and with each FP8 recipe. Tolerance: every
step's flow-matching loss within 0.005 of bf16's (measured: at most 0.0005 over the recipes;
the loss is 1.3 to 4.3 by the step's timesteps), and not equal to it (the FP8 GEMMs ran).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs longboat-diffusion's megatron backend")

from diffusion_testkit import randn, tensor_parallel_state

from longboat.core.distributed import run_multiprocess

LOSS_TOL = 0.005
STEPS = 5


def _worker(rank: int, world: int, recipes: list[str | None]) -> dict[str, Any]:
    from longboat.core.config.schema import OptimConfig
    from longboat.core.megatron.linears import KernelColumnParallelLinear, KernelRowParallelLinear
    from longboat.diffusion.models.wan import model as wan
    from longboat.diffusion.models.wan.config import flavor
    from longboat.diffusion.objective.flow_matching import FlowMatchingConfig
    from longboat.diffusion.train.step import DiffusionTrainStep
    from longboat.diffusion.train.training import build_dit

    cfg = dataclasses.replace(flavor("tiny"), num_layers=4)
    batch = {
        "latents": randn(1, cfg.in_channels, 3, 8, 8, seed=1),
        "text_embeds": randn(1, 6, cfg.text_dim, seed=2),
        "text_mask": torch.ones(1, 6, dtype=torch.bool),
        "captions": ["a red square"],
    }
    out: dict[str, Any] = {}
    with tensor_parallel_state(1):
        state = None
        for recipe in recipes:
            model = build_dit(wan, cfg, "bf16", recipe)
            if state is None:  # zero-initialised weights (the output projection) drawn, so
                # that the blocks' outputs reach the loss from the first step
                g = torch.Generator().manual_seed(3)
                state = {
                    k: (torch.randn(v.shape, generator=g) * 0.05).to(v.dtype)
                    if not v.any() and v.dim() == 2 else v.detach().clone()
                    for k, v in model.named_parameters()
                }  # fmt: skip
            with torch.no_grad():
                for k, v in model.named_parameters():
                    v.copy_(state[k])
            kinds = (KernelColumnParallelLinear, KernelRowParallelLinear)
            linears = [m for m in model.modules() if isinstance(m, kinds)]
            step = DiffusionTrainStep(
                model, OptimConfig(lr=3e-3), precision="bf16", objective=FlowMatchingConfig(),
                seed=0, device=torch.device("cpu"), microbatches=1,
            )  # fmt: skip
            losses = []
            for i in range(STEPS):
                losses.append(float(step.forward_backward(i, [batch])))
                step.update()
            out[str(recipe)] = {
                "linears": (sum(m.linear_fn is not None for m in linears), len(linears)),
                "loss": losses,
            }
    return out


@pytest.mark.multiprocess
def test_fp8_dit_follows_bf16() -> None:
    recipes = [None, "blockwise", "rowwise", "tensorwise"]
    (out,) = run_multiprocess(_worker, 1, recipes)
    base = out["None"]
    assert base["linears"] == (0, 0), base  # bf16: megatron's linears with the bias epilogue
    for recipe in recipes[1:]:
        res = out[recipe]
        assert res["linears"] == (20, 40), (recipe, res)  # blocks 2 and 3 of 4: 10 linears each
        diffs = [abs(a - b) for a, b in zip(res["loss"], base["loss"], strict=True)]
        assert max(diffs) <= LOSS_TOL, (recipe, diffs, base["loss"])
        assert max(diffs) > 0, (recipe, "FP8 losses equal bf16's: the FP8 GEMMs did not run")


def test_fp8_keys_compose_and_cpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """The diffusion stack takes ``train.precision=fp8`` and its recipes at compose time; a run
    on a device without FP8 matmuls is a ConfigError naming ``train.precision`` (exit 2)."""
    from longboat.core.config.compose import compose_experiment
    from longboat.diffusion.cli import main

    cfg = compose_experiment(
        "quickstart", ["train.precision=fp8", "train.fp8.recipe=rowwise"], stack="diffusion"
    )
    assert cfg.train.precision == "fp8" and cfg.train.fp8.recipe == "rowwise"
    code = main(["train", "experiment=quickstart", "train.precision=fp8", "train.steps=1"])
    text = capsys.readouterr()
    assert code == 2, text
    assert "train.precision='fp8'" in text.err + text.out
