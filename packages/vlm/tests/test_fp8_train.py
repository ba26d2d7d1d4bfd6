"""``train.precision=fp8`` in the vlm stack: the language decoder's linears on longboat's FP8
linear (the llm decoders' wiring, ``build_run_model(..., fp8_recipe=...)``), emulated on CPU
(dequantise, multiply in fp32; the command line refuses a device without FP8 matmuls, tested
below).

A tiny Qwen2.5-VL with a 4-layer decoder (the middle two layers' 8 linears in FP8; the first
and last layers, the vision tower, projector, embeddings and head in bf16) takes 6 AdamW steps
from the same weights on a fixed batch of two packed image rows with bf16 GEMMs and with each
FP8 recipe. Tolerance: every step's loss within 0.08 of bf16's and the last within 0.05 (the
llm test's; measured: at most 0.015 on a step and 0.015 at the end over the recipes, the
loss falling from 5.97 to 4.37), and not equal to it (the FP8 GEMMs ran).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from vlm_testkit import packed_image_row

from longboat.core.distributed import run_multiprocess

LOSS_TOL = 0.08
FINAL_TOL = 0.05
STEPS = 6


def _worker(rank: int, world: int, recipes: list[str | None]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.config.schema import OptimConfig
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.linears import KernelColumnParallelLinear, KernelRowParallelLinear
    from longboat.vlm.models.qwen2_5_vl import model as qwen
    from longboat.vlm.train.step import VLMTrainStep
    from longboat.vlm.train.training import build_run_model

    run = compose_experiment("quickstart", [], stack="vlm")
    tiny = qwen.flavor("tiny")
    cfg = dataclasses.replace(tiny, language=dataclasses.replace(tiny.language, num_layers=4))
    batch = [packed_image_row(cfg, 0, [[1, 4, 4], [1, 4, 8]]), packed_image_row(cfg, 1, [[1, 8, 4]])]  # fmt: skip
    kinds = (KernelColumnParallelLinear, KernelRowParallelLinear)

    def on(part: torch.nn.Module) -> list[bool]:
        return [m.linear_fn is not None for m in part.modules() if isinstance(m, kinds)]

    out: dict[str, Any] = {}
    state = None
    with parallel_state.single_process():
        for recipe in recipes:
            model, _, _ = build_run_model(run, qwen, cfg, "bf16", "cpu", fp8_recipe=recipe)
            if state is None:
                state = {k: v.detach().clone() for k, v in model.named_parameters()}
            with torch.no_grad():
                for k, v in model.named_parameters():
                    v.copy_(state[k])
            optim = OptimConfig(lr=3e-3, weight_decay=0.0, grad_clip=1.0)
            step = VLMTrainStep(model, optim, precision="bf16")
            losses = []
            for _ in range(STEPS):
                losses.append(float(step.forward_backward(batch)))
                step.update()
            out[str(recipe)] = {
                "language": (sum(on(model.language)), len(on(model.language))),
                "vision": sum(on(model.vision)),
                "loss": losses,
            }
    return out


@pytest.mark.multiprocess
def test_fp8_vlm_follows_bf16() -> None:
    recipes = [None, "blockwise", "rowwise", "tensorwise"]
    (out,) = run_multiprocess(_worker, 1, recipes)
    base = out["None"]
    assert base["language"] == (0, 0), base  # bf16: megatron's linears with the bias epilogue
    assert base["loss"][-1] < base["loss"][0] - 0.1, base  # the steps train
    for recipe in recipes[1:]:
        res = out[recipe]
        assert res["language"] == (8, 16), (recipe, res)  # decoder layers 2 and 3
        assert res["vision"] == 0, (recipe, res)  # the tower stays in bf16
        diffs = [abs(a - b) for a, b in zip(res["loss"], base["loss"], strict=True)]
        assert max(diffs) <= LOSS_TOL and diffs[-1] <= FINAL_TOL, (recipe, diffs)
        assert max(diffs) > 0, (recipe, "FP8 losses equal bf16's: the FP8 GEMMs did not run")


def test_fp8_keys_compose_and_cpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """The vlm stack takes ``train.precision=fp8`` and its recipes at compose time, refuses a
    layer backend without longboat's FP8 linears there, and a run on a device without FP8
    matmuls is a ConfigError naming ``train.precision`` (exit 2)."""
    from longboat.core.config.compose import compose_experiment
    from longboat.core.config.errors import ConfigError
    from longboat.vlm.cli import main

    cfg = compose_experiment(
        "quickstart", ["train.precision=fp8", "train.fp8.recipe=adaptive"], stack="vlm"
    )
    assert cfg.train.precision == "fp8" and cfg.train.fp8.recipe == "adaptive"
    with pytest.raises(ConfigError) as err:
        compose_experiment("quickstart", ["train.precision=fp8", "model.layer_backend=te"],
                           stack="vlm")  # fmt: skip
    assert "model.layer_backend" in err.value.keys
    code = main(["train", "experiment=quickstart", "train.precision=fp8", "train.steps=1"])
    text = capsys.readouterr()
    assert code == 2, text
    assert "train.precision='fp8'" in text.err + text.out
