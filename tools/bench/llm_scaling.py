"""LLM scaling on one host: DP=2 vs DP=1 tokens/s, TP=2 vs TP=1 loss curve.

    python tools/bench/llm_scaling.py --results-dir benchmarks/results [--out results.json]
        [--tiny] [--steps 20] [--warmup 5] [--tp-steps 50] [--time-budget S]
        [--no-overlap-grad-reduce] [--no-extra-runs]

The model is llm_throughput's (``FULL``: the 886M Llama-style config; ``--tiny``: its tiny
shapes), seq 2048, micro-batch 8 per GPU, bf16, trained through the product's step:
``longboat.llm.train.train_step.build_train_step`` (longboat layer spec, megatron DDP +
distributed optimizer with fused AdamW, wgrad accumulation fusion, fused linear CE where it
applies, the sync-free optimizer step). One process per device (``torch.multiprocessing``,
spawn), NCCL on CUDA, gloo on CPU (``--tiny``). Each phase runs in its own process group and
megatron parallel state, torn down before the next:

1. ``dp1``: one rank (GPU 0), ``--warmup`` + ``--steps`` steps on random tokens, AdamW
   without clipping (as llm_throughput).
2. ``dp2``: two ranks, data parallel, each rank its own micro-batch 8 (weak scaling: the
   global batch doubles), megatron DDP with ``overlap_grad_reduce`` (the grad
   reduce-scatter runs bucket by bucket during backward). ``build_train_step`` has no knob
   for it (``wrap_and_build`` hard-codes ``overlap_grad_reduce=False``), so this script
   sets it by wrapping megatron's ``DistributedDataParallelConfig`` while the step is built
   (``--no-overlap-grad-reduce``: the product default).
3. ``tp1`` / ``tp2``: a ``transformers.LlamaForCausalLM`` (seeded random init) saved with
   ``save_pretrained`` and loaded with ``longboat.llm.hf.load_hf`` into the step built at
   TP=1 and at TP=2 (then ``optimizer.reload_model_params()``: ``build_train_step`` copies
   the fp32 main weights at build time), trained ``--tp-steps`` steps on the same batches
   (llm_loss_alignment's Markov chain, same LR warm-up, AdamW, grad clip 1.0). Reports
   max and mean |loss_TP2 - loss_TP1| per step. TP=1 computes the loss with fused linear CE,
   TP=2 with megatron's vocab-parallel cross-entropy on the logits (the product's choice).
4. extra runs, when time is left (``--no-extra-runs`` skips them): ``dp2_no_overlap``
   (``dp2`` with the product's DDP, no overlap: what the overlap buys) and
   ``dp2_overlap_param_gather`` (``dp2`` plus megatron's ``overlap_param_gather``: the
   distributed optimizer's bf16 param all-gather runs bucket by bucket under the next
   forward instead of synchronously at the end of the optimizer step).

Per throughput run: median step time over the timed steps (each step ends with a device
synchronize; rank 0's clock), tokens/s total and per GPU, MFU per GPU (llm_throughput's
FLOP accounting, 989 TFLOP/s), peak device memory of every rank.

``--time-budget``: the whole script (process start-up, model builds, HF save) in seconds;
phases are skipped (recorded as such) when the time left is short, ``--tp-steps`` shrinks to
what fits, and the parent kills the workers at the budget + 15 s. Rank 0 writes
``<results-dir>/llm_scaling_<date>.{json,md,png}`` (and ``--out``) after every phase and
prints the tables last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llm_throughput as lt
from bench_env import pyplot
from bench_procs import agree, gather, report_failure, run_workers
from llm_loss_alignment import lr_at, markov_batches

DATE = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
TP_CLIP = 1.0
TP_LR_WARMUP = 10
DP_SCALING_TARGET = 1.9
ATTENTION_ENV = "LONGBOAT_ATTENTION_BACKEND"  # longboat.kernels.attention.ENV_VAR
# Rough seconds a phase needs besides its steps (process group, build, HF save / load).
PHASE_OVERHEAD_S = {
    "dp1": 20.0, "dp2": 20.0, "tp1": 35.0, "tp2": 25.0,
    "dp2_no_overlap": 20.0, "dp2_overlap_param_gather": 20.0,
}  # fmt: skip
PHASES = tuple(PHASE_OVERHEAD_S)
EXTRA_RUNS = ("dp2_no_overlap", "dp2_overlap_param_gather")


# ----------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def ddp_config_overrides(**overrides: Any):  # type: ignore[no-untyped-def]
    """While the step is built, megatron's ``DistributedDataParallelConfig`` takes
    ``overrides`` (``wrap_and_build`` imports it from ``megatron.core.distributed`` at call
    time and exposes no DDP knobs)."""
    import megatron.core.distributed as mdist

    original = mdist.DistributedDataParallelConfig

    def make(*args: Any, **kw: Any) -> Any:
        kw.update(overrides)
        return original(*args, **kw)

    mdist.DistributedDataParallelConfig = make  # type: ignore[misc]
    try:
        yield
    finally:
        mdist.DistributedDataParallelConfig = original  # type: ignore[misc]


def ddp_settings(ts: Any) -> dict[str, Any]:
    cfg = ts.model[0].ddp_config
    return {
        "overlap_grad_reduce": bool(cfg.overlap_grad_reduce),
        "overlap_param_gather": bool(cfg.overlap_param_gather),
        "grad_reduce_in_fp32": bool(cfg.grad_reduce_in_fp32),
        "bucket_size": cfg.bucket_size,
        "use_distributed_optimizer": bool(cfg.use_distributed_optimizer),
        "gradient_accumulation_fusion": bool(ts.chunks[0].config.gradient_accumulation_fusion),
        "fused_linear_ce_applies": _fused_ce_applies(ts),
    }


def _fused_ce_applies(ts: Any) -> bool:
    from longboat.llm.train.loss import fused_loss_applies

    return bool(ts.fused_linear_ce and fused_loss_applies(ts.model[0]))


class Phase:
    """One process group + megatron parallel state for ``world`` ranks (ranks >= world idle)."""

    def __init__(self, rank: int, world: int, port: int, acc: Any, tp: int, seed: int) -> None:
        self.rank, self.world, self.port, self.acc, self.tp, self.seed = (
            rank, world, port, acc, tp, seed,
        )  # fmt: skip

    def __enter__(self) -> Any:
        import torch.distributed as dist

        from longboat.core.config.schema import ParallelConfig
        from longboat.core.megatron import parallel_state

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(self.port)
        backend = self.acc.dist_backend if self.acc.device_type == "cuda" else "gloo"
        kw: dict[str, Any] = {}
        if self.acc.device_type == "cuda":
            kw["device_id"] = self.acc.device(self.rank)
        dist.init_process_group(
            backend=backend,
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=180),
            **kw,
        )
        try:
            return parallel_state.initialize(
                ParallelConfig(tensor_parallel=self.tp), self.acc, seed=self.seed
            )
        except BaseException:
            dist.destroy_process_group()
            raise

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        from longboat.core.megatron import parallel_state

        with contextlib.suppress(Exception):
            if parallel_state.current_layout() is not None:
                parallel_state.destroy()
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
        gc.collect()
        self.acc.empty_cache()


# ----------------------------------------------------------------------------- phases


def ddp_for(phase: str, args: argparse.Namespace) -> dict[str, Any]:
    """megatron DDP settings a throughput phase overrides ({}: the product's)."""
    if phase == "dp2":
        return {"overlap_grad_reduce": True} if args.overlap_grad_reduce else {}
    if phase == "dp2_overlap_param_gather":
        return {"overlap_grad_reduce": True, "overlap_param_gather": True}
    return {}


def optim_config(clip: float) -> Any:
    from longboat.core.config.schema import OptimConfig

    return OptimConfig(
        name="adamw", lr=lt.LR, weight_decay=lt.WD, betas=list(lt.BETAS), eps=lt.EPS,
        grad_clip=clip,
    )  # fmt: skip


def throughput_phase(
    c: dict[str, int],
    acc: Any,
    args: argparse.Namespace,
    *,
    ddp: dict[str, Any],
    pick_attention: bool = False,
) -> dict[str, Any]:
    """Time the product step at the live layout; every rank returns its own numbers."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    from longboat.llm.train.train_step import build_train_step

    device = acc.device()
    gc.collect()
    acc.empty_cache()
    leftover = acc.memory_stats().get("allocated_gb", 0.0)  # from earlier phases (~0)
    acc.reset_peak_memory_stats()
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    notes: dict[str, Any] = {"allocated_at_start_gb": round(leftover, 3)}
    if pick_attention and device.type == "cuda":
        # Once (dp1, rank 0); later phases and ranks take its choice (ATTENTION_ENV).
        notes["attention"] = lt.pick_attention_backend(c, acc)
    else:
        notes["attention"] = os.environ.get(ATTENTION_ENV, "sdpa (auto)")
    with ddp_config_overrides(**ddp):
        ts = build_train_step(lt.llm_config(c, "longboat"), optim_config(0.0), device=device)
    notes["ddp"] = ddp_settings(ts)
    build_s = time.perf_counter() - t0
    dp_rank = mps.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(args.seed + 1000 * dp_rank)  # own data per DP rank
    seqs = torch.randint(0, c["vocab"], (4, c["micro_batch"], c["seq"] + 1), generator=gen)
    batches = [(s[:, :-1].to(device), s[:, 1:].to(device)) for s in seqs]
    times: list[float] = []
    losses: list[torch.Tensor] = []
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.warmup + args.steps):
        tokens, labels = batches[i % len(batches)]
        acc.synchronize()
        ts_ = time.perf_counter()
        loss = ts.step(tokens, labels)
        acc.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - ts_)
        losses.append(loss)
    loop_s = time.perf_counter() - t0
    mem = acc.memory_stats()
    out = {
        "rank": dist.get_rank(),
        "median_step_s": statistics.median(times),
        "step_times_s": times,
        "losses": [float(x) for x in losses],
        "peak_mem_gb": mem.get("peak_allocated_gb", 0.0),
        "build_s": build_s,
        "warmup_plus_timed_s": loop_s,
        "notes": notes,
    }
    del ts, batches, losses
    return out


def summarize_throughput(
    name: str, per_rank: list[dict[str, Any]], c: dict[str, int], world: int
) -> dict[str, Any]:
    r0 = per_rank[0]
    med = r0["median_step_s"]
    # Every rank's step ends with the loss all-reduce, so rank 0's step time is the step's.
    per_gpu = c["micro_batch"] * c["seq"] / med
    return {
        "name": name,
        "gpus": world,
        "tokens_per_s": per_gpu * world,
        "tokens_per_s_per_gpu": per_gpu,
        "mfu_per_gpu": per_gpu * lt.flops_per_token(c) / lt.PEAK_BF16_FLOPS,
        "median_step_s": med,
        "median_step_s_per_rank": [r["median_step_s"] for r in per_rank],
        "step_times_s": r0["step_times_s"],
        "peak_mem_gb_per_gpu": [r["peak_mem_gb"] for r in per_rank],
        "peak_mem_gb": max(r["peak_mem_gb"] for r in per_rank),
        "losses": r0["losses"],
        "build_s": r0["build_s"],
        "warmup_plus_timed_s": r0["warmup_plus_timed_s"],
        "notes": r0["notes"],
    }


def save_hf_init(c: dict[str, int], hf_dir: Path, seed: int, device: torch.device) -> None:
    """The llm_loss_alignment init: a seeded HF Llama (rms eps 1e-5) in ``hf_dir``."""
    torch.manual_seed(seed)
    hf = lt.hf_model(c, device)
    hf.config.rms_norm_eps = 1e-5
    for m in hf.modules():
        if hasattr(m, "variance_epsilon"):
            m.variance_epsilon = 1e-5
    hf.save_pretrained(hf_dir)
    del hf
    gc.collect()


def tp_phase(
    c: dict[str, int], acc: Any, args: argparse.Namespace, hf_dir: Path, steps: int
) -> dict[str, Any]:
    """Train ``steps`` steps from the HF weights at the live layout; returns the losses."""
    from longboat.llm.hf import load_hf, read_hf_config
    from longboat.llm.train.optimizer import inner_optimizers
    from longboat.llm.train.train_step import build_train_step

    device = acc.device()
    gc.collect()
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    cfg = read_hf_config(hf_dir)
    cfg.layer_backend = "longboat"
    ts = build_train_step(cfg, optim_config(TP_CLIP), device=device)
    load_hf(ts.chunks, cfg, hf_dir)
    # build_train_step copied the (random) weights into the fp32 main weights: refresh them.
    ts.optimizer.reload_model_params()
    notes = {"ddp": ddp_settings(ts)}
    build_s = time.perf_counter() - t0
    batches = markov_batches(
        c["vocab"], steps, c["micro_batch"], c["seq"], args.seed, fanout=4, active=2048
    )
    inner = inner_optimizers(ts.optimizer)
    losses: list[torch.Tensor] = []
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        for opt in inner:
            for g in opt.param_groups:
                g["lr"] = lr_at(i, lt.LR, TP_LR_WARMUP)
        losses.append(ts.step(b[:, :-1].to(device), b[:, 1:].to(device)))
    acc.synchronize()
    out = {
        "losses": [float(x) for x in losses],
        "build_s": build_s,
        "loop_s": time.perf_counter() - t0,
        "peak_mem_gb": acc.memory_stats().get("peak_allocated_gb", 0.0),
        "notes": notes,
    }
    del ts
    return out


# ----------------------------------------------------------------------------- worker


def worker(
    rank: int,
    nprocs: int,
    decisions: Any,
    barrier: Any,
    ports: dict[str, int],
    args: argparse.Namespace,
    t_start: float,
    hf_dir: str,
    meta: dict[str, Any],
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1" if args.tiny else "8")
    from longboat.core.device import get_accelerator

    acc = get_accelerator("cpu" if args.tiny else None)
    if acc.device_type == "cuda":
        acc.set_device(rank)
    c = dict(lt.TINY if args.tiny else lt.FULL)
    result = meta
    phases = [ph for ph in PHASES if not (args.no_extra_runs and ph in EXTRA_RUNS)]
    tp_steps = args.tp_steps
    step_estimate = 0.0
    measured_overhead: float | None = None  # dp1's wall minus its steps (rank 0)

    def overhead(phase: str) -> float:
        if measured_overhead is None:
            return PHASE_OVERHEAD_S[phase]
        hf_save = 15.0 if phase == "tp1" and not args.tiny else 0.0
        return 1.5 * measured_overhead + hf_save + 2.0

    for phase in phases:
        world = 1 if phase in ("dp1", "tp1") else nprocs

        # Rank 0 decides whether the phase runs (and the TP step count); others follow.
        def decide(phase: str = phase, step_estimate: float = step_estimate) -> dict[str, Any]:
            nonlocal tp_steps
            left = args.time_budget - (time.time() - t_start) if args.time_budget else math.inf
            steps_cost = (
                (args.warmup + args.steps) * step_estimate * 1.5
                if phase.startswith("dp")
                else tp_steps * step_estimate * 2.0
            )
            if phase == "tp1" and args.time_budget and step_estimate > 0:
                # TP1 + TP2 (two runs of the same count) must fit in what is left.
                room = left - overhead("tp1") - overhead("tp2") - 10
                tp_steps = max(2, min(args.tp_steps, int(room / (3.0 * step_estimate))))
                steps_cost = tp_steps * step_estimate * 2.0
            reason = None
            if left <= overhead(phase) + steps_cost:
                reason = f"time budget ({left:.0f}s left)"
            if phase == "tp2" and not result.get("tp1_losses"):
                reason = "tp1 did not run"
            return {
                "run": reason is None,
                "reason": reason,
                "tp_steps": tp_steps,
                "attention": os.environ.get(ATTENTION_ENV),
            }

        decision = agree(rank, nprocs, decisions, decide, max(60.0, args.time_budget or 600.0))
        tp_steps = decision["tp_steps"]
        if rank != 0:
            if decision["attention"] is None:
                os.environ.pop(ATTENTION_ENV, None)
            else:
                os.environ[ATTENTION_ENV] = decision["attention"]
        if not decision["run"]:
            if rank == 0:
                result["skipped"].append(f"{phase}: skipped: {decision['reason']}")
                print(f"== {phase}: skipped: {decision['reason']}", flush=True)
        elif rank < world:
            if rank == 0:
                print(f"== {phase} ({world} process(es))", flush=True)
            t_phase = time.perf_counter()
            try:
                if phase == "tp1" and rank == 0:
                    t0 = time.perf_counter()
                    save_hf_init(c, Path(hf_dir), args.seed, acc.device())
                    result["tp"]["hf_save_s"] = time.perf_counter() - t0
                tp = 2 if phase == "tp2" else 1
                with Phase(rank, world, ports[phase], acc, tp, seed=1234):
                    if phase.startswith("dp"):
                        mine = throughput_phase(
                            c, acc, args, ddp=ddp_for(phase, args), pick_attention=phase == "dp1"
                        )
                        per_rank = gather(mine)
                        if rank == 0:
                            r = summarize_throughput(phase, per_rank, c, world)
                            result["runs"].append(r)
                            if phase == "dp1":
                                step_estimate = r["median_step_s"]
                                measured_overhead = (
                                    time.perf_counter() - t_phase - r["warmup_plus_timed_s"]
                                )
                            print(
                                f"   {r['tokens_per_s']:.0f} tokens/s ({r['tokens_per_s_per_gpu']:.0f}"
                                f"/GPU), peak {r['peak_mem_gb']:.1f} GB, build {r['build_s']:.1f}s "
                                f"{r['notes']}",
                                flush=True,
                            )
                    else:
                        out = tp_phase(c, acc, args, Path(hf_dir), tp_steps)
                        if rank == 0:
                            result[f"{phase}_losses"] = out["losses"]
                            out.pop("losses")
                            result["tp"][phase] = out
                            print(
                                f"   first/last loss {result[f'{phase}_losses'][0]:.4f} / "
                                f"{result[f'{phase}_losses'][-1]:.4f}, build {out['build_s']:.1f}s,"
                                f" loop {out['loop_s']:.1f}s",
                                flush=True,
                            )
            except Exception as exc:
                traceback.print_exc()
                if rank == 0:
                    result["errors"].append(f"{phase}: {type(exc).__name__}: {exc}")
                    if phase.startswith("dp"):
                        result["runs"].append(
                            {"name": phase, "error": f"{type(exc).__name__}: {exc}"}
                        )
            if rank == 0 and phase == "tp1":
                result["tp"]["steps"] = tp_steps
        if rank == 0:
            finish(result, args, t_start)
            write(result, args)  # partial results survive a kill
        barrier.wait(timeout=max(120.0, args.time_budget or 900.0))
    if rank == 0:
        print(tables(result), flush=True)


# ----------------------------------------------------------------------------- results


def finish(result: dict[str, Any], args: argparse.Namespace, t_start: float) -> None:
    runs = {r["name"]: r for r in result["runs"] if "tokens_per_s" in r}
    if "dp1" in runs:
        for name in ("dp2", *EXTRA_RUNS):
            if name in runs:
                runs[name]["scaling_vs_dp1"] = (
                    runs[name]["tokens_per_s"] / runs["dp1"]["tokens_per_s"]
                )
        if "dp2" in runs:
            result["dp_scaling"] = runs["dp2"]["scaling_vs_dp1"]
            result["dp_scaling_meets_target"] = result["dp_scaling"] >= DP_SCALING_TARGET
    if "dp2" in runs:
        # Overlap changes when the reductions run, not what they compute.
        for name in EXTRA_RUNS:
            if name in runs:
                runs[name]["max_abs_loss_diff_vs_dp2"] = max(
                    abs(x - y) for x, y in zip(runs[name]["losses"], runs["dp2"]["losses"])
                )
    a, b = result.get("tp1_losses"), result.get("tp2_losses")
    if a and b and len(a) == len(b):
        diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
        result["tp"]["abs_loss_diff"] = diffs
        result["tp"]["max_abs_loss_diff"] = max(diffs)
        result["tp"]["mean_abs_loss_diff"] = sum(diffs) / len(diffs)
        result["tp"]["first_step_rel_diff"] = abs(a[0] - b[0]) / abs(a[0])
        result["max_abs_loss_diff"] = max(diffs)
    result["wall_s"] = time.time() - t_start


def tables(result: dict[str, Any]) -> str:
    lines = [
        "| run | GPUs | tokens/s total | tokens/s per GPU | vs dp1 | MFU per GPU | "
        "peak mem per GPU (GB) | median step (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        if "tokens_per_s" not in r:
            err = str(r.get("error", "?")).splitlines()[0][:90].replace("|", "/")
            lines.append(f"| {r['name']} | failed: {err} | | | | | | |")
            continue
        ratio = f"{r['scaling_vs_dp1']:.3f}x" if "scaling_vs_dp1" in r else "-"
        mem = ", ".join(f"{m:.1f}" for m in r["peak_mem_gb_per_gpu"])
        lines.append(
            f"| {r['name']} | {r['gpus']} | {r['tokens_per_s'] / 1e3:.1f}k | "
            f"{r['tokens_per_s_per_gpu'] / 1e3:.1f}k | {ratio} | {r['mfu_per_gpu']:.1%} | "
            f"{mem} | {r['median_step_s']:.4f} |"
        )
    tp = result["tp"]
    lines += [
        "",
        "| TP check | steps | first loss TP1 / TP2 | last loss TP1 / TP2 | max abs diff | "
        "mean abs diff |",
        "|---|---|---|---|---|---|",
    ]
    a, b = result.get("tp1_losses"), result.get("tp2_losses")
    if "max_abs_loss_diff" in tp:
        lines.append(
            f"| TP=2 vs TP=1 | {len(a)} | {a[0]:.4f} / {b[0]:.4f} | {a[-1]:.4f} / {b[-1]:.4f} | "
            f"{tp['max_abs_loss_diff']:.4f} | {tp['mean_abs_loss_diff']:.4f} |"
        )
    else:
        lines.append("| TP=2 vs TP=1 | not run (see errors / skipped) | | | | |")
    if "dp_scaling" in result:
        lines.append(
            f"\nDP=2 / DP=1 tokens/s: {result['dp_scaling']:.3f}x (target >= {DP_SCALING_TARGET}x)"
        )
    for line in result["skipped"] + result["errors"]:
        lines.append(f"- {line}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = [r for r in result["runs"] if "tokens_per_s" in r]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    if runs:
        a1.bar([r["name"] for r in runs], [r["tokens_per_s"] / 1e3 for r in runs], color="tab:blue")
        dp1 = next((r for r in runs if r["name"] == "dp1"), None)
        if dp1:
            a1.axhline(2 * dp1["tokens_per_s"] / 1e3, color="gray", ls="--", lw=0.8, label="2x dp1")
            a1.axhline(
                DP_SCALING_TARGET * dp1["tokens_per_s"] / 1e3,
                color="r",
                lw=0.8,
                label="target 1.9x",
            )
            a1.legend()
    a1.set_ylabel("tokens/s total (thousands)")
    a1.tick_params(axis="x", rotation=15)
    for name, style in (("tp1_losses", "-"), ("tp2_losses", "--")):
        if result.get(name):
            a2.plot(result[name], label=name.split("_")[0].upper().replace("TP", "TP="), ls=style)
    a2.set_xlabel("step")
    a2.set_ylabel("loss")
    if result.get("tp1_losses"):
        a2.legend()
    cfg = result["config"]
    fig.suptitle(
        f"llm_scaling {result['date']} {result['gpu']}: {cfg['params'] / 1e6:.1f}M params, "
        f"seq {cfg['seq']}, micro-batch {cfg['micro_batch']}/GPU, bf16"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict[str, Any], args: argparse.Namespace) -> None:
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.results_dir is None:
        return
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / f"llm_scaling_{result['date']}"
    stem.with_suffix(".json").write_text(text)
    cfg = result["config"]
    head = (
        f"# llm_scaling {result['date']}\n\n{result['gpu']}, commit {result['commit']}, "
        f"versions {json.dumps(result['versions'])}\n\n"
        f"Llama-style {cfg['params'] / 1e6:.1f}M params (hidden {cfg['hidden']}, "
        f"{cfg['layers']} layers, {cfg['heads']} heads / {cfg['kv_heads']} KV), seq {cfg['seq']}, "
        f"micro-batch {cfg['micro_batch']} per GPU, bf16, the product step (build_train_step). "
        f"Throughput: median of {cfg['steps']} steps after {cfg['warmup']} warm-up, AdamW "
        f"without clipping; dp2 with overlap_grad_reduce={cfg['overlap_grad_reduce']}. "
        f"TP check: same HF init and Markov batches, AdamW, clip {TP_CLIP}, LR warm-up "
        f"{TP_LR_WARMUP}.\n\n"
    )
    stem.with_suffix(".md").write_text(head + tables(result) + "\n")
    plot(result, stem.with_suffix(".png"))


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, gloo on CPU (smoke)")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps per throughput run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tp-steps", type=int, default=50, help="steps of the TP loss curves")
    p.add_argument("--time-budget", type=float, default=0, help="seconds for everything (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-overlap-grad-reduce",
        dest="overlap_grad_reduce",
        action="store_false",
        help="dp2 with the product's DDP (no overlapped grad reduce-scatter)",
    )
    p.add_argument("--no-extra-runs", action="store_true", help=f"skip {', '.join(EXTRA_RUNS)}")
    args = p.parse_args(argv)
    t_start = time.time()
    if args.nprocs != 2:
        p.error("--nprocs: the scaling phases compare 1 vs 2 processes; use 2")
    if not args.tiny and (not torch.cuda.is_available() or torch.cuda.device_count() < args.nprocs):
        p.error(f"needs {args.nprocs} CUDA devices (use --tiny for the CPU smoke)")
    c = dict(lt.TINY if args.tiny else lt.FULL)
    meta: dict[str, Any] = {
        "benchmark": "llm_scaling",
        "date": DATE,
        "gpu": "cpu" if args.tiny else lt.gpu_name(),
        "gpus": args.nprocs,
        "versions": lt.versions("transformers", "triton", "megatron-core"),
        "commit": lt.git_commit(),
        "config": {
            **c,
            "flavor": "tiny" if args.tiny else "886m",
            "params": lt.param_count(c),
            "precision": "bf16",
            "steps": args.steps,
            "warmup": args.warmup,
            "tp_steps_requested": args.tp_steps,
            "overlap_grad_reduce": args.overlap_grad_reduce,
            "backend": "gloo (cpu)" if args.tiny else "nccl",
            "step": "longboat.llm.train.train_step.build_train_step",
            "flops_per_token": lt.flops_per_token(c),
            "peak_flops": lt.PEAK_BF16_FLOPS,
            "time_budget_s": args.time_budget,
        },
        "runs": [],
        "tp": {"clip": TP_CLIP, "lr": lt.LR, "lr_warmup": TP_LR_WARMUP,
               "data": "llm_loss_alignment.markov_batches (2048 active ids, 4 successors)"},
        "dp_scaling_target": DP_SCALING_TARGET,
        "skipped": [],
        "errors": [],
    }  # fmt: skip
    ports = {ph: free_port() for ph in PHASES}
    hf_dir = tempfile.mkdtemp(prefix="llm_scaling_hf_")
    try:
        codes, killed = run_workers(
            worker, args.nprocs, (ports, args, t_start, hf_dir, meta),
            time_budget=args.time_budget, t_start=t_start,
        )  # fmt: skip
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)
    written = args.out or (
        args.results_dir / f"llm_scaling_{DATE}.json" if args.results_dir else None
    )
    return 1 if report_failure(codes, killed, written, tables) else 0


if __name__ == "__main__":
    raise SystemExit(main())
