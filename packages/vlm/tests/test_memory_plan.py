"""The megatron memory plan (core's ``megatron.engine.memory_shapes``) on the vlm stack: the
vision tower and the decoder counted together.

- the estimator's parameter, gradient and optimizer-state bytes equal the exact bytes of the
  built tiny models (megatron DDP's fp32 grad buffer, the distributed optimizer's fp32 main
  weights and AdamW moments), tower and decoder;
- its activation estimate is within 10% of what the tiny models (a packed row of two images)
  save for the backward, counted by saved-tensor hooks (unique storages; parameters, the
  batch and the CPU's document masks left out: a GPU runs varlen attention, no mask) with
  the longboat kernels in Triton's interpreter, for recompute none and full;
- the chooser on recorded budgets (Qwen2.5-VL-3B, 8K-token rows): none, full, refusal with
  the numbers;
- ``train.memory_budget`` on a run: a GB budget chooses ``train.recompute`` (written back and
  built into the tower and decoder), auto on the CPU keeps none and reports, a pinned
  recompute that cannot fit is refused before work.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess
from longboat.core.engine.memory.budget import GB

FAMILIES = ("qwen2_5_vl", "qwen3_vl")  # RMSNorm + SwiGLU tower; LayerNorm + GELU + deepstack
STATE_FAMILIES = (*FAMILIES, "qwen3_vl_moe")  # + the Qwen3-MoE decoder's router and experts
GRIDS = [[1, 8, 8], [1, 4, 8]]
"""The probe row's images (t, h, w in patches): 96 patches."""


def composed_shapes(family: str, cfg: Any, *, tokens: int, seq_len: int, precision: str) -> Any:
    """The run's ``ComposedShapes`` of ``cfg`` as ``VLMTraining.plan_memory`` builds them
    (one rank)."""
    from longboat.core.family import find_family
    from longboat.core.megatron.engine.memory_plan import DecoderShapes
    from longboat.core.megatron.engine.memory_shapes import ComposedShapes

    e = 4 if precision == "fp32" else 2
    module = find_family("vlm", family).load()
    tower = module.tower_shapes(cfg.vision, tokens=tokens, weight_bytes=e)
    decoder = DecoderShapes.of(cfg.language, seq_len=seq_len, precision=precision,
                               fused_ce=False,
                               fused_qkv_rope=cfg.language.mrope_section is None)  # fmt: skip
    return ComposedShapes(decoder=decoder, encoders=(tower,))


def _row(cfg: Any) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from vlm_testkit import packed_image_row

    return packed_image_row(cfg, 0, GRIDS)


# ----------------------------------------------------------------------------- state bytes


def _state_worker(rank: int, world: int) -> dict[str, dict[str, int]]:
    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.family import find_family
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.optimizer import inner_optimizers
    from longboat.vlm.train.step import VLMTrainStep

    out = {}
    for family in STATE_FAMILIES:
        parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
        try:
            module = find_family("vlm", family).load()
            cfg = module.flavor("tiny")
            model = module.build(cfg, precision="bf16", device_type="cpu")
            step = VLMTrainStep(model, OptimConfig(lr=1e-3), precision="bf16")
            step.forward_backward([_row(cfg)])
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
            out[family] = got
        finally:
            parallel_state.destroy()
    return out


@pytest.mark.multiprocess
def test_state_bytes_equal_the_built_model() -> None:
    """Weights, the fp32 grad buffer, fp32 main weights and AdamW moments of the built tiny
    VLMs (tower, mergers, decoder) == the estimator's, byte for byte."""
    from longboat.core.family import find_family
    from longboat.core.megatron.engine.memory_plan import OptimizerPlan, decoder_state_bytes

    (built,) = run_multiprocess(_state_worker, 1, timeout=600)
    for family, got in built.items():
        cfg = find_family("vlm", family).load().flavor("tiny")
        shapes = composed_shapes(family, cfg, tokens=96, seq_len=64, precision="bf16")
        opt = OptimizerPlan(precision="bf16", bf16_grads_single_pass=False)
        est = decoder_state_bytes(shapes.stage_params(), opt, microbatches=1,
                                  fp32_params=shapes.stage_fp32_params())  # fmt: skip
        assert shapes.stage_params() == got["params"], (family, got)
        assert (est.weights, est.grads, est.masters, est.moments) == (
            got["weights"], got["grads"], got["masters"], got["moments"],
        ), (family, got, est)  # fmt: skip


# ----------------------------------------------------------------------------- activations

_SAVED = """
import os, socket, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ["MASTER_PORT"] = str(s.getsockname()[1])
os.environ["MASTER_ADDR"] = "127.0.0.1"
dist.init_process_group("gloo", rank=0, world_size=1)
from longboat.core.config.schema import ParallelConfig
from longboat.core.device import get_accelerator
from longboat.core.family import find_family
from longboat.core.megatron import parallel_state
from longboat.kernels.layers import longboat_layer_kernels
from vlm_testkit import packed_image_row
parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
kernels = longboat_layer_kernels(rope=False, qkv_rope=False)  # the M-RoPE decoders' kernels
for family in ("qwen2_5_vl", "qwen3_vl"):
    module = find_family("vlm", family).load()
    cfg = module.flavor("tiny")
    for mode, parts in (("none", ()), ("full", ("vision", "language"))):
        model = module.build(cfg, precision="bf16", device_type="cpu", kernels=kernels,
                             recompute=parts)
        row = packed_image_row(cfg, 0, GRIDS)
        row["pixel_values"] = row["pixel_values"].bfloat16()
        batch = [v for v in row.values() if isinstance(v, torch.Tensor)]
        skip = {t.untyped_storage()._cdata for t in (*model.parameters(), *batch)}
        seen = {}
        def pack(t):
            key = t.untyped_storage()._cdata
            square = t.dim() == 4 and t.shape[:2] == (1, 1) and t.shape[2] == t.shape[3]
            if key not in skip and not square:  # square: the CPU's document mask
                seen[key] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(row["input_ids"], pixel_values=row["pixel_values"],
                  image_grid_thw=row["image_grid_thw"], labels=row["labels"],
                  cu_seqlens=row["cu_seqlens"])
        print("SAVED", family, mode, row["input_ids"].shape[1], sum(seen.values()))
parallel_state.destroy()
""".replace("GRIDS", repr(GRIDS))


@pytest.mark.multiprocess
def test_activation_estimate_matches_saved_tensors(tmp_path: Path) -> None:
    """What the tiny VLMs' forward (a packed row of two images, 96 patches; bf16; Triton
    kernels in the interpreter) saves for the backward, within 10% of the estimate, for
    recompute none and full (tower and decoder)."""
    from longboat.core.family import find_family

    pytest.importorskip("triton")
    script = tmp_path / "saved.py"
    script.write_text(_SAVED)
    env = {**os.environ, "TRITON_INTERPRET": "1", "LONGBOAT_KERNELS_IMPL": "triton",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("SAVED")]
    assert len(rows) == 4, done.stdout
    for family, mode, seq, measured in rows:
        cfg = find_family("vlm", family).load().flavor("tiny")
        shapes = composed_shapes(family, cfg, tokens=96, seq_len=int(seq), precision="bf16")
        est = shapes.stage_saved(0, 1, mode) + shapes.stage_tail(0, 1)[0]
        print(family, mode, est, measured)
        assert abs(est - int(measured)) <= 0.1 * int(measured), (family, mode, est, measured)


# ----------------------------------------------------------------------------- the chooser


def _qwen2_5_vl_3b(**kw: Any) -> Any:
    """Qwen2.5-VL-3B at 8192-token rows holding 16384 patches (4096 merged image tokens), one
    rank, bf16: predicted peaks (GB) none 120.4 (activations 54.6), full 73.0 (7.2)."""
    from longboat.core.family import find_family
    from longboat.core.megatron.engine.memory_plan import DecoderShapes
    from longboat.core.megatron.engine.memory_shapes import ComposedShapes

    cfg = find_family("vlm", "qwen2_5_vl").load().flavor("3b")
    tower = (
        find_family("vlm", "qwen2_5_vl")
        .load()
        .tower_shapes(cfg.vision, tokens=16384, weight_bytes=2)
    )
    decoder = DecoderShapes.of(cfg.language, seq_len=8192, precision="bf16", fused_ce=False,
                               fused_qkv_rope=False)  # fmt: skip
    return ComposedShapes(decoder=decoder, encoders=(tower,), **kw)


def _choose(shapes: Any, budget_gb: float | None, recompute: str | None = None) -> Any:
    from longboat.core.megatron.engine.memory_plan import OptimizerPlan, choose_decoder_plan

    opt = OptimizerPlan(precision="bf16", bf16_grads_single_pass=False)
    return choose_decoder_plan(shapes, opt, micro_batch=1, accum=1,
                               budget=None if budget_gb is None else budget_gb * GB,
                               budget_source="test", recompute=recompute,
                               micro_batch_pinned=True, recompute_modes=("none", "full"))  # fmt: skip


def test_chooser_decisions_on_recorded_budgets() -> None:
    """121 GB keeps everything, 80 GB recomputes the tower and the decoder, 72 GB fits
    nothing (the error gives 73.0 GB), a pinned none at 80 GB is refused (120.4 GB); a
    recompute kept off the tower (train.recompute_components=[language]) costs its
    activations back."""
    roomy = _choose(_qwen2_5_vl_3b(), 121)
    assert roomy.choice.recompute == "none"
    assert round(roomy.estimate.total / GB, 1) == 120.4
    full = _choose(_qwen2_5_vl_3b(), 80)
    assert full.choice.recompute == "full" and round(full.estimate.total / GB, 1) == 73.0
    assert "chose train.recompute=full" in full.line()
    with pytest.raises(ConfigError) as err:
        _choose(_qwen2_5_vl_3b(), 72)
    assert err.value.keys == ["train.memory_budget"]
    assert "72.0 GB" in str(err.value) and "needs 73.0 GB" in str(err.value)
    with pytest.raises(ConfigError) as err:
        _choose(_qwen2_5_vl_3b(), 80, recompute="none")
    assert "train.recompute=none" in str(err.value) and "needs 120.4 GB" in str(err.value)
    language_only = _choose(_qwen2_5_vl_3b(recompute_encoders=False), 121)
    full_language = _choose(_qwen2_5_vl_3b(recompute_encoders=False), None, recompute="full")
    assert language_only.choice.recompute == "none"
    assert full.estimate.total < full_language.estimate.total < roomy.estimate.total
    unbudgeted = _choose(_qwen2_5_vl_3b(), None)
    assert unbudgeted.choice.recompute == "none" and unbudgeted.budget is None


# ----------------------------------------------------------------------------- on a run

TINY = [
    "data.num_train=24",
    "data.num_eval=4",
    "data.seq_len=256",
    "train.precision=bf16",
    "vlm.cpu_precision=bf16",
    "vlm.answer_eval_samples=0",
    "vlm.eval_batches=1",
    "logging.progress=false",
    "logging.trackers=[]",
]


def _plan_worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.vlm.train.training import build_training

    try:
        # fp32 moments pinned: the recompute / split choices alone (bf16 moments, the plan's
        # last lever: llm's test_memory_plan_moments)
        pinned = [*overrides, "optim.moment_dtype=fp32"]
        run = build_training(compose_experiment("quickstart", pinned, stack="vlm"))
    except ConfigError as exc:
        return {"error": str(exc), "keys": exc.keys}
    try:
        plan, model = run.memory_plan, run.step_fn.model
        return {
            "recompute": run.cfg.train.recompute,
            "built": (model.vision.recompute, model.language.config.recompute_granularity),
            "line": plan.line(),
            "options": {c.recompute: e.total for c, e in plan.options},
            "peak_lines": len(run.callbacks()),
            "describe": run.describe(),
        }
    finally:
        run.close()


def _plans_worker(rank: int, world: int, base: list[str]) -> dict[str, dict[str, Any]]:
    out = {"auto": _plan_worker(rank, world, base),
           "roomy": _plan_worker(rank, world, [*base, "train.memory_budget=100"])}  # fmt: skip
    total = {k: v / GB for k, v in out["roomy"]["options"].items()}
    mid = (total["none"] + total["full"]) / 2
    out["full"] = _plan_worker(rank, world, [*base, f"train.memory_budget={mid:.9f}"])
    low = total["full"] * 0.999
    out["low"] = _plan_worker(rank, world, [*base, f"train.memory_budget={low:.9f}"])
    pins = [*base, "train.recompute=none", f"train.memory_budget={mid:.9f}"]
    out["pinned"] = _plan_worker(rank, world, pins)
    return out


@pytest.mark.multiprocess
def test_run_plans_to_a_gb_budget_and_reports_without_one(tmp_path: Path) -> None:
    """On the CPU, auto keeps recompute none and reports the plan; a GB budget between the
    estimates of none and full chooses full, written back and built into the tower and the
    decoder; one below full, or a pinned none below none, is refused before work."""
    base = [*TINY, f"output_dir={tmp_path / 'run'}", f"data.out_dir={tmp_path / 'data'}"]
    (runs,) = run_multiprocess(_plans_worker, 1, base, timeout=900)
    auto, roomy, full = runs["auto"], runs["roomy"], runs["full"]
    assert auto["recompute"] == "none" and auto["built"] == (False, None), auto
    assert auto["line"].startswith("Memory plan: no budget (the cpu device reports no memory")
    assert auto["line"] in auto["describe"]
    assert roomy["recompute"] == "none" and roomy["peak_lines"] == 1, roomy
    assert roomy["options"]["full"] < roomy["options"]["none"]
    assert full["recompute"] == "full" and full["built"] == (True, "full"), full
    assert "chose train.recompute=full" in full["line"]
    for refused in (runs["low"], runs["pinned"]):
        assert refused.get("keys") == ["train.memory_budget"], refused
    assert "train.recompute=none" in runs["pinned"]["error"]
    assert "does not fit" in runs["low"]["error"]


def _cli_worker(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    from longboat.vlm.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()


@pytest.mark.multiprocess
def test_numeric_budget_through_the_command_line(tmp_path: Path) -> None:
    """``longboat-vlm train ... train.memory_budget=0.01`` passes the command line's
    validation as a number of GB and is refused before training, exit 2, with the plan's
    numbers."""
    # In a forked worker: a CLI run in the test process leaves threads (data generation,
    # tokenizers) that deadlock the forked workers of later tests.
    args = [*TINY, f"output_dir={tmp_path / 'run'}", f"data.out_dir={tmp_path / 'data'}"]
    argv = ["train", "experiment=quickstart", *args, "train.memory_budget=0.01"]
    ((code, out),) = run_multiprocess(_cli_worker, 1, argv, timeout=600)
    assert code == 2, out
    assert "train.memory_budget" in out and "does not fit 10.2 MB" in out and "needs" in out
