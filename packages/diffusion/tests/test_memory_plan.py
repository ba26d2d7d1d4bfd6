"""The megatron memory plan (core's ``megatron.engine.memory_plan``) on the diffusion stack:
a Wan DiT's shapes (``train.memory.WanShapes``).

- the estimator's parameter, gradient and optimizer-state bytes equal the exact bytes of the
  built tiny Wan (its fp32-kept norms and modulation tables included; megatron DDP's grad
  buffer, bf16 at one micro-batch a step and fp32 at two; the distributed optimizer's fp32
  main weights and AdamW moments);
- its activation estimate is within 10% of what the tiny Wan's forward and an fp32 loss on
  its prediction save for the backward, counted by saved-tensor hooks (unique storages;
  parameters and the batch left out), with longboat's kernels in Triton's interpreter, for
  recompute none and full; selective adds the self-attention outputs its checkpoint caches
  (torch keeps them outside the saved-tensor hooks);
- the chooser on recorded budgets (Wan 2.1 1.3B, 49 frames at 480x832: 20,280 tokens a
  sample): none, selective, full, a split micro-batch, refusal with the numbers;
- ``train.memory_budget`` on a run: a GB budget chooses ``train.recompute`` (written back
  and built into the model), auto on the CPU keeps none and reports, a pinned recompute that
  cannot fit is refused before work, a number passes the command line.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import longboat.diffusion.models.wan.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess
from longboat.core.engine.memory.budget import GB
from longboat.diffusion.train.memory import wan_shapes

SHAPE = (3, 8, 8)
"""The probe's latent (frames, height, width): 48 tokens a sample at patch (1, 2, 2)."""
BATCH, TEXT = 2, 7


def _tiny() -> Any:
    from longboat.diffusion.models.wan.config import flavor

    return flavor("tiny")


def _tiny_shapes() -> Any:
    return wan_shapes(_tiny(), tokens=48, captions=1, text_len=TEXT, precision="bf16")


# ----------------------------------------------------------------------------- state bytes


def _state_worker(rank: int, world: int) -> dict[int, dict[str, int]]:
    import torch

    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.optimizer import inner_optimizers
    from longboat.diffusion.models.wan.model import build
    from longboat.diffusion.objective.flow_matching import FlowMatchingConfig
    from longboat.diffusion.train.step import DiffusionTrainStep

    out = {}
    for microbatches in (1, 2):
        parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
        try:
            model = build(_tiny(), precision="bf16")
            step = DiffusionTrainStep(model, OptimConfig(lr=1e-3), precision="bf16",
                                      objective=FlowMatchingConfig(), seed=0,
                                      device=torch.device("cpu"),
                                      microbatches=microbatches)  # fmt: skip
            for p in model.parameters():  # a gradient in every buffer, then the update
                p.main_grad.add_(1e-3)
            step.optimizer.step()  # the moments exist now
            params = list(model.parameters())
            got = {
                "params": sum(p.numel() for p in params),
                "weights": sum(p.numel() * p.element_size() for p in params),
                "grads": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params),
                "masters": 0,
                "moments": 0,
            }
            for opt in inner_optimizers(step.optimizer):
                for group in opt.param_groups:
                    for p in group["params"]:
                        got["masters"] += p.numel() * p.element_size()
                        state = opt.state[p]
                        got["moments"] += sum(state[k].numel() * state[k].element_size()
                                              for k in ("exp_avg", "exp_avg_sq"))  # fmt: skip
            out[microbatches] = got
        finally:
            parallel_state.destroy()
    return out


@pytest.mark.multiprocess
def test_state_bytes_equal_the_built_model() -> None:
    """Weights (the fp32 norms and tables at 4 bytes), grads (bf16 buffer at one micro-batch
    a step, fp32 at two; the fp32 parameters' fp32 either way), fp32 main weights and AdamW
    moments of the built tiny Wan == the estimator's, byte for byte."""
    from longboat.core.megatron.engine.memory_plan import OptimizerPlan, decoder_state_bytes

    (built,) = run_multiprocess(_state_worker, 1, timeout=600)
    shapes = _tiny_shapes()
    for microbatches, got in built.items():
        est = decoder_state_bytes(shapes.stage_params(), OptimizerPlan(precision="bf16"),
                                  microbatches=microbatches,
                                  fp32_params=shapes.stage_fp32_params())  # fmt: skip
        assert shapes.stage_params() == got["params"], got
        assert (est.weights, est.grads, est.masters, est.moments) == (
            got["weights"], got["grads"], got["masters"], got["moments"],
        ), (microbatches, got, est)  # fmt: skip


# ----------------------------------------------------------------------------- activations

_SAVED = (
    """
import dataclasses, os, socket, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ["MASTER_PORT"] = str(s.getsockname()[1])
os.environ["MASTER_ADDR"] = "127.0.0.1"
dist.init_process_group("gloo", rank=0, world_size=1)
from longboat.core.config.schema import ParallelConfig
from longboat.core.device import get_accelerator
from longboat.core.megatron import parallel_state
from longboat.diffusion.models.wan.config import flavor
from longboat.diffusion.models.wan.model import build
parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
g = torch.Generator().manual_seed(0)
for mode, blocks, attention in (("none", 0, False), ("full", -1, True)):
    cfg = dataclasses.replace(flavor("tiny"), recompute_blocks=blocks,
                              recompute_attention=attention)
    model = build(cfg, precision="bf16")
    latents = torch.randn(BATCH, cfg.in_channels, *SHAPE, generator=g)
    timesteps = torch.rand(BATCH, generator=g) * 1000
    text = torch.randn(BATCH, TEXT, cfg.text_dim, generator=g)
    skip = {t.untyped_storage()._cdata for t in (*model.parameters(), latents, timesteps, text)}
    seen = {}
    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(latents, timesteps, text).float().pow(2).mean()
    print("SAVED", mode, sum(seen.values()))
parallel_state.destroy()
""".replace("BATCH", str(BATCH))
    .replace("TEXT", str(TEXT))
    .replace("SHAPE", repr(SHAPE))
)


@pytest.mark.multiprocess
def test_activation_estimate_matches_saved_tensors(tmp_path: Path) -> None:
    """What the tiny Wan (2 samples of 48 tokens, 7 caption tokens; bf16; Triton kernels in
    the interpreter) and an fp32 loss on its prediction save for the backward, within 10% of
    the estimate, for recompute none and full."""
    pytest.importorskip("triton")
    script = tmp_path / "saved.py"
    script.write_text(_SAVED)
    env = {**os.environ, "TRITON_INTERPRET": "1", "LONGBOAT_KERNELS_IMPL": "triton",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("SAVED")]
    assert [r[0] for r in rows] == ["none", "full"], done.stdout
    shapes = _tiny_shapes()
    for mode, measured in rows:
        est = shapes.stage_saved(0, BATCH, mode) + shapes.stage_tail(0, BATCH)[0]
        assert abs(est - int(measured)) <= 0.1 * int(measured), (mode, est, measured)
    # selective: full plus each block's cached self-attention output and log-sum-exp
    t, h, a = BATCH * 48, shapes.hidden, shapes.heads
    gap = shapes.stage_saved(0, BATCH, "selective") - shapes.stage_saved(0, BATCH, "full")
    assert gap == shapes.layers * (2 * t * h + 4 * t * a)


# ----------------------------------------------------------------------------- the chooser


def _wan_1_3b() -> Any:
    """Wan 2.1 1.3B, 49 frames at 480x832 (latent 13 x 60 x 104: 20,280 tokens), a 512-token
    caption, bf16, one rank, micro-batch 2 (4 samples a step): predicted peaks (GB) at
    micro-batch 2: none 125.6, selective 35.9, full 32.3; at 1: none 75.0, full 28.3."""
    from longboat.diffusion.models.wan.config import flavor

    return wan_shapes(flavor("t2v_1_3b"), tokens=13 * 30 * 52, captions=1, text_len=512,
                      precision="bf16")  # fmt: skip


def _choose(budget_gb: float | None, recompute: str | None = None, **kw: Any) -> Any:
    from longboat.core.megatron.engine.memory_plan import OptimizerPlan, choose_decoder_plan

    return choose_decoder_plan(_wan_1_3b(), OptimizerPlan(precision="bf16"), micro_batch=2,
                               accum=2, budget=None if budget_gb is None else budget_gb * GB,
                               budget_source="test", recompute=recompute, **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("budget_gb", "pinned", "expected"),
    [
        (130, None, ("none", 2)),
        (40, None, ("selective", 2)),
        (34, None, ("full", 2)),
        (30, None, ("full", 1)),
        (80, "none", ("none", 1)),  # a pinned recompute: only the micro-batch splits
    ],
)
def test_chooser_decisions_on_recorded_budgets(
    budget_gb: float, pinned: str | None, expected: tuple[str, int]
) -> None:
    """The cheapest choice that fits: none, selective, full, then the smaller micro-batch
    (4 samples a step kept)."""
    plan = _choose(budget_gb, pinned)
    assert (plan.choice.recompute, plan.choice.micro_batch) == expected
    assert plan.estimate.total <= budget_gb * GB


def test_chooser_refuses_what_cannot_fit_with_the_numbers() -> None:
    """Nothing fits 25 GB (the smallest plan, full at micro-batch 1, needs 28.3 GB); a pinned
    selective recompute with the micro-batch held needs 35.9 GB of 33; without a budget
    the defaults stay; train.recompute_layers recomputes only the first blocks."""
    with pytest.raises(ConfigError) as err:
        _choose(25)
    assert err.value.keys == ["train.memory_budget"]
    assert "25.0 GB" in str(err.value) and "needs 28.3 GB" in str(err.value)
    with pytest.raises(ConfigError) as err:
        _choose(33, "selective", micro_batch_pinned=True)
    assert "train.recompute=selective" in str(err.value) and "needs 35.9 GB" in str(err.value)
    plan = _choose(None)
    assert (plan.choice.recompute, plan.choice.micro_batch, plan.budget) == ("none", 2, None)
    half = _choose(None, "selective", full_layers=15).estimate.total
    every = _choose(None, "selective").estimate.total
    assert every < half < plan.estimate.total


# ----------------------------------------------------------------------------- on a run

TINY = [
    "data.num_samples=16",
    "data.num_eval_samples=8",
    "data.shapes=[[1,4,4],[3,4,4]]",
    "model.overrides.num_layers=2",
    "model.overrides.num_attention_heads=2",
    "model.overrides.ffn_dim=64",
    "model.overrides.attention_head_dim=16",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.precision=bf16",
    "diffusion.cpu_precision=bf16",
    "logging.progress=false",
    "logging.trackers=[]",
    "diffusion.preview=false",
]


def _plan_worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.diffusion.train.training import build_training

    try:
        # fp32 moments pinned: the recompute / split choices alone (bf16 moments, the plan's
        # last lever: llm's test_memory_plan_moments)
        pinned = [*overrides, "optim.moment_dtype=fp32"]
        run = build_training(compose_experiment("quickstart", pinned, stack="diffusion"))
    except ConfigError as exc:
        return {"error": str(exc), "keys": exc.keys}
    try:
        t, plan, model = run.cfg.train, run.memory_plan, run.step_fn.model
        return {
            "recompute": t.recompute,
            "micro": t.micro_batch_size,
            "accum": run.accumulation,
            "built": (model.recompute_blocks, model.recompute_attention),
            "line": plan.line(),
            "options": {(c.recompute, c.micro_batch): e.total for c, e in plan.options},
            "peak_lines": sum(type(c).__name__ == "MeasuredPeak" for c in run.callbacks()),
            "describe": run.describe(),
        }
    finally:
        run.close()


def _plans_worker(rank: int, world: int, base: list[str]) -> dict[str, dict[str, Any]]:
    out = {"auto": _plan_worker(rank, world, base),
           "roomy": _plan_worker(rank, world, [*base, "train.memory_budget=100"])}  # fmt: skip
    total = {k: v / GB for k, v in out["roomy"]["options"].items()}
    between = {
        "selective": (total[("none", 4)] + total[("selective", 4)]) / 2,
        "full": (total[("selective", 4)] + total[("full", 4)]) / 2,
        "split": (total[("full", 4)] + total[("full", 2)]) / 2,
    }
    for name, gb in between.items():
        out[name] = _plan_worker(rank, world, [*base, f"train.memory_budget={gb:.9f}"])
    pins = [*base, "train.recompute=none", "train.cuda_graph=true",
            f"train.memory_budget={between['full']:.9f}"]  # fmt: skip
    out["pinned"] = _plan_worker(rank, world, pins)
    return out


@pytest.mark.multiprocess
def test_run_plans_to_a_gb_budget_and_reports_without_one(tmp_path: Path) -> None:
    """On the CPU, auto keeps recompute none (micro-batch 4) and reports the plan; GB budgets
    between the estimates choose selective (every block, attention outputs kept), full
    (attention too), then micro-batch 2 with full (8 samples a step kept), written back into
    train.* and the built model; a pinned none with one micro-batch a step that cannot fit is
    refused before work."""
    base = [*TINY, f"output_dir={tmp_path / 'run'}", f"data.out_dir={tmp_path / 'data'}"]
    (runs,) = run_multiprocess(_plans_worker, 1, base, timeout=900)
    auto, roomy = runs["auto"], runs["roomy"]
    assert (auto["recompute"], auto["micro"], auto["built"]) == ("none", 4, (0, False)), auto
    assert auto["line"].startswith("Memory plan: no budget (the cpu device reports no memory")
    assert auto["line"] in auto["describe"]
    assert roomy["recompute"] == "none" and roomy["peak_lines"] == 1, roomy
    sel, full, split = runs["selective"], runs["full"], runs["split"]
    assert (sel["recompute"], sel["built"]) == ("selective", (-1, False)), sel
    assert (full["recompute"], full["built"]) == ("full", (-1, True)), full
    assert (split["recompute"], split["micro"], split["accum"]) == ("full", 2, 4), split
    assert "micro-batch 4 -> 2" in split["line"]
    assert runs["pinned"].get("keys") == ["train.memory_budget"], runs["pinned"]
    assert "train.recompute=none" in runs["pinned"]["error"]


def test_numeric_budget_through_the_command_line(tmp_path: Path) -> None:
    """``longboat-diffusion train ... train.memory_budget=0.01`` passes the command line's
    validation as a number of GB and is refused before training, exit 2, with the plan's
    numbers."""
    # In a child process: a CLI run in the test process leaves threads (data generation,
    # tokenizers) that deadlock the forked workers of later tests.
    args = [*TINY, f"output_dir={tmp_path / 'run'}", f"data.out_dir={tmp_path / 'data'}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, "-m", "longboat.diffusion.cli", "train", "experiment=quickstart", *args,
         "train.memory_budget=0.01"],
        env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "train.memory_budget" in out and "does not fit 10.2 MB" in out and "needs" in out


def test_recompute_null_builds_no_recompute_until_planned() -> None:
    """A composed config with train.recompute null (the default) checks as none."""
    from longboat.diffusion.train.checks import recompute_fields

    train = dataclasses.make_dataclass("T", [("recompute", Any), ("recompute_layers", Any)])
    assert recompute_fields(train(None, None)) == {"recompute_blocks": 0,
                                                  "recompute_attention": False}  # fmt: skip
    assert recompute_fields(train("selective", 3)) == {"recompute_blocks": 3,
                                                      "recompute_attention": False}  # fmt: skip
