"""VLA data-parallel scaling on one host: GR00T-N1.6 training at DP=2 vs DP=1 (weak scaling).

    python tools/bench/vla_scaling.py --results-dir benchmarks/results [--out x.json] [--tiny]
        [--steps 20] [--warmup 5] [--batch 32] [--workers 8] [--time-budget S]
        [--variants longboat_graphed,longboat_master,longboat]

Issue 8 asks for the DP=2 scaling of the GR00T-N1.6 training on two H200s. Each variant is
``vla_throughput``'s longboat run (``vla_throughput.run_longboat``: the embodied trainer's
dataset, collator, ``RankMicroBatches`` loader, model build, freezing, ``parallelize``,
``build_optimizer`` and step, timed by its ``_loop`` / ``bench_timing.StepClock``), run twice:

1. ``<variant>_dp1``: one process on GPU 0 (the single-GPU number of vla_throughput).
2. ``<variant>_dp2``: two processes, one per GPU (NCCL; gloo on CPU for ``--tiny``), each with
   the same per-GPU batch ``--batch`` (weak scaling: the global batch doubles), the product's
   data parallelism: ``ParallelSetup(world_size=2, rank=r)``, a ``BatchLayout`` of global
   batch 2 x ``--batch`` over 2 DP ranks, ``RankMicroBatches(dp_rank=r)`` (each rank reads
   its own half of every global batch) and the step's ``rank_offset=r`` (each rank its own
   flow-matching noise / time draws), as the embodied trainer sets them.

Variants: ``longboat_master`` (``train.master_weights``: ``parallelize(...,
master_weights=True)`` does not wrap the model in DDP; ``MasterWeightAdamW.prepare_grads``
all-reduces the flat bf16 grad buffer with one collective after the backward, no overlap),
``longboat_graphed`` (the same step replayed as one CUDA graph: the grad all-reduce and the
loss all-reduce are captured in the graph), ``longboat`` (fp32 trainable weights + bf16
autocast, torch DDP: bucketed grad all-reduce overlapping the backward,
``find_unused_parameters=True`` as the product sets it).

``run_longboat`` takes the rank and world size and sets those itself; this script passes a
``RankMicroBatches`` subclass whose batches carry their sample indices from the loader to the
step, so the result records which samples each rank trained on (``same_step_overlap``:
samples two ranks both trained on in the same step; 0 when every rank reads its own shard).

Per run: samples/s total (all ranks' samples over the slowest rank's timed wall clock, data
loading included) and per GPU, the DP=2 / DP=1 ratio of the same variant (2.0 = perfect weak
scaling), median device step time (``StepClock``, rank 0; every rank's in the JSON), the
host's median enqueue time and batch wait, peak device memory of every rank, MFU per GPU
(vla_throughput's FLOP count against 989 TFLOP/s). Loss check: DP=2's step-0 loss (the
step's loss averaged over both ranks, as ``train_step`` all-reduces it) must be finite and
within ``LOSS_RANGE`` (25%) of DP=1's (same init; rank 0 of DP=2 trains DP=1's first batch
with the same draws, rank 1 the next batch of the sample order). Sync check: after the run
every rank holds the same weights (float64 sum and sum of squares of the trained parameters,
compared exactly), although the ranks trained on different samples.

Process structure as ``llm_scaling.py``: the parent writes the dataset (vla_throughput's
``make_dataset``, reused from ``--data-dir`` when complete) and spawns one worker per GPU;
each phase runs in its own process group (``longboat.core.distributed.init_distributed``
from RANK / WORLD_SIZE / MASTER_* set per phase, torn down after it); rank 0 decides whether
a phase fits the time left (``--time-budget``: the whole script in seconds) and the others
follow; the parent kills the workers at the budget + 15 s. Steps run a fixed count (no
in-loop deadline: two ranks that stopped at different steps would hang in the all-reduce).
Rank 0 writes ``<results-dir>/vla_scaling_<date>.{json,md,png}`` (``_tiny`` suffix with
``--tiny``) and ``--out`` after every phase and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vla_throughput as vt
from bench_env import key_values, pyplot
from bench_procs import agree, gather, report_failure, run_workers

from longboat.core.distributed import (
    destroy_distributed,
    find_free_port,
    init_distributed,
)
from longboat.embodied.train.loader import RankMicroBatches

DATE = vt.DATE
MODEL = "groot_n1_6"
VARIANTS = ("longboat_graphed", "longboat_master", "longboat")
SAMPLE_KEY = "_bench_sample_indices"
LOSS_RANGE = 0.25
"""DP=2's step-0 loss must lie within this relative distance of DP=1's."""
DEFAULT_PHASE_S = {"full": 45.0, "tiny": 15.0}
"""Seconds a phase is assumed to take before one was measured (build + warm-up + steps)."""
TEXT_LEN = 24  # vla_throughput's FLOP count assumes this prompt length


# ----------------------------------------------------------------------------- rank wrapper


class TaggedMicroBatches(RankMicroBatches):
    """``RankMicroBatches`` whose collated batches carry their sample indices under
    ``SAMPLE_KEY`` (also from loader workers), for the step side to record."""

    def __getitem__(self, k: int) -> dict[str, Any]:
        batch = super().__getitem__(k)
        accum = self.plan.layout.accum
        step, a = divmod(k, accum)
        indices = self.plan.micro_batch_indices(step, self.dp_rank * accum + a)
        batch[SAMPLE_KEY] = torch.tensor(indices, dtype=torch.int64)
        return batch


# ----------------------------------------------------------------------------- phases


def phase_names(variants: list[str]) -> list[tuple[str, str, int]]:
    """``(name, variant, world)`` of every phase: each variant at DP=1, then DP=2."""
    return [(f"{v}_dp{w}", v, w) for v in variants for w in (1, 2)]


def run_phase(
    rank: int, world: int, acc: Any, cfg: Any, args: argparse.Namespace, variant: str
) -> dict[str, Any]:
    """Time ``variant`` as rank ``rank`` of ``world``; every rank returns its own numbers."""
    vt._free(acc)
    leftover = acc.memory_stats().get("allocated_gb", 0.0)  # from earlier phases (~0)
    vt_args = argparse.Namespace(
        model=MODEL, batch=args.batch, steps=args.steps, warmup=args.warmup,
        workers=args.workers, seed=args.seed, profile_steps=0, profile_dir=None,
        sync_every_step=False,
    )  # fmt: skip
    seen: list[list[int]] = []

    def record(batch: dict[str, Any]) -> dict[str, Any]:
        seen.append(batch.pop(SAMPLE_KEY).tolist())
        return batch

    keep: dict[str, Any] = {}
    t0 = time.perf_counter()
    # No deadline inside the loop: ranks must run the same number of steps.
    timer, wall, counts = vt.run_longboat(
        acc, cfg, args.data_dir, vt_args, math.inf, variant, rank=rank, world_size=world,
        micro_batches=TaggedMicroBatches, prepare=record, keep=keep,
    )  # fmt: skip
    phase_s = time.perf_counter() - t0
    checksum = params_checksum(keep["optimizer"])
    out = timer.summary(args.batch, args.warmup, args.flops, wall)
    out.update(
        rank=rank,
        wall_s=wall,
        phase_s=phase_s,
        step_times_s=timer.device,
        peak_mem_gb=acc.memory_stats()["peak_allocated_gb"],
        params=counts,
        samples=seen,
        params_checksum=checksum,
        allocated_at_start_gb=leftover,
    )
    return out


@torch.no_grad()
def params_checksum(optimizer: torch.optim.Optimizer) -> list[float]:
    """Sum and sum of squares (float64) of the trained parameters after the run: equal on
    every rank when the ranks averaged their gradients (they trained on different data)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    total = sum(p.double().sum() for p in params)
    squares = sum(p.double().square().sum() for p in params)
    return [float(total), float(squares)]


def same_step_overlap(samples: list[list[list[int]]]) -> int:
    """Samples that two ranks both trained on in the same step (0: disjoint shards)."""
    overlap = 0
    for r in range(len(samples)):
        for q in range(r + 1, len(samples)):
            for a, b in zip(samples[r], samples[q]):
                overlap += len(set(a) & set(b))
    return overlap


def summarize(name: str, variant: str, world: int, per_rank: list[dict[str, Any]],
              batch: int) -> dict[str, Any]:  # fmt: skip
    """One run's entry from every rank's ``run_phase`` output (rank order)."""
    errors = [f"rank {r['rank']}: {r['error']}" for r in per_rank if "error" in r]
    if errors:
        return {"name": name, "variant": variant, "gpus": world, "error": "; ".join(errors)}
    r0 = per_rank[0]
    steps = r0["timed_steps"]
    if any(r["timed_steps"] != steps for r in per_rank):
        raise RuntimeError(f"{name}: ranks timed different step counts")
    wall = max(r["wall_s"] for r in per_rank)
    total = world * batch * steps / wall
    samples = [r["samples"] for r in per_rank]
    return {
        "name": name,
        "variant": variant,
        "gpus": world,
        "batch_per_gpu": batch,
        "global_batch": batch * world,
        "samples_per_s": total,
        "samples_per_s_per_gpu": total / world,
        "median_step_s": r0["median_step_s"],
        "median_step_s_per_rank": [r["median_step_s"] for r in per_rank],
        "step_times_s": r0["step_times_s"],
        "host_step_s": r0["host_step_s"],
        "data_wait_s": max(r["data_wait_s"] for r in per_rank),
        "mfu_per_gpu": sum(r["mfu"] for r in per_rank) / world,
        "peak_mem_gb_per_gpu": [r["peak_mem_gb"] for r in per_rank],
        "peak_mem_gb": max(r["peak_mem_gb"] for r in per_rank),
        "wall_s_per_rank": [r["wall_s"] for r in per_rank],
        "phase_s": max(r["phase_s"] for r in per_rank),
        "timed_steps": steps,
        "warmup_steps": r0["warmup_steps"],
        "timing": r0["timing"],
        "losses": r0["losses"],  # the step's loss, averaged over the ranks (train_step)
        "params": r0["params"],
        "step0_samples_per_rank": [s[0] if s else [] for s in samples],
        "steps_seen_per_rank": [len(s) for s in samples],
        "same_step_overlap": same_step_overlap(samples) if world > 1 else None,
        "params_checksum_per_rank": [r["params_checksum"] for r in per_rank],
        "allocated_at_start_gb_per_rank": [r["allocated_at_start_gb"] for r in per_rank],
    }


def finish(result: dict[str, Any]) -> None:
    """DP=2 / DP=1 ratios, the loss check and the shard check, per variant."""
    runs = {r["name"]: r for r in result["runs"] if "samples_per_s" in r}
    result["dp_scaling"] = {}
    result["checks"] = {}
    for variant in result["config"]["variants"]:
        one, two = runs.get(f"{variant}_dp1"), runs.get(f"{variant}_dp2")
        if not (one and two):
            continue
        ratio = two["samples_per_s"] / one["samples_per_s"]
        two["scaling_vs_dp1"] = ratio
        two["scaling_efficiency"] = ratio / two["gpus"]
        result["dp_scaling"][variant] = ratio
        l1, l2 = one["losses"][0], two["losses"][0]
        rel = abs(l2 - l1) / abs(l1) if l1 else math.inf
        two["step0_loss_rel_diff_vs_dp1"] = rel
        result["checks"][variant] = {
            "step0_loss_dp1": l1,
            "step0_loss_dp2_mean_over_ranks": l2,
            "step0_loss_rel_diff": rel,
            "loss_in_range": math.isfinite(l2) and rel <= LOSS_RANGE,
            "ranks_read_disjoint_shards": two["same_step_overlap"] == 0,
            # Different data, averaged gradients: the same weights on every rank afterwards.
            "ranks_params_equal": all(
                c == two["params_checksum_per_rank"][0] for c in two["params_checksum_per_rank"]
            ),
            # Rank 0 of DP=2 reads what DP=1 reads (the first micro-batch of the order).
            "dp2_rank0_reads_dp1_samples": (
                two["step0_samples_per_rank"][0] == one["step0_samples_per_rank"][0]
            ),
        }


# ----------------------------------------------------------------------------- worker


def worker(
    rank: int,
    nprocs: int,
    decisions: Any,
    barrier: Any,
    ports: dict[str, int],
    args: argparse.Namespace,
    t_start: float,
    meta: dict[str, Any],
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1" if args.tiny else "4")
    from longboat.core.device import get_accelerator
    from longboat.embodied.models import get_config

    acc = get_accelerator("cpu" if args.tiny else None)
    if acc.device_type == "cuda":
        acc.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    cfg = get_config(MODEL, "tiny" if args.tiny else "full", args.overrides)
    result = meta
    last_phase_s: float | None = None
    wait_s = max(180.0, args.time_budget or 900.0)
    for name, variant, world in phase_names(args.variants):
        left = args.time_budget - (time.time() - t_start) if args.time_budget else math.inf
        need = 1.3 * (last_phase_s or DEFAULT_PHASE_S["tiny" if args.tiny else "full"])
        reason = agree(
            rank, nprocs, decisions,
            lambda left=left, need=need: (
                f"time budget ({left:.0f}s left, ~{need:.0f}s needed)" if left < need else None
            ),
            wait_s,
        )  # fmt: skip
        if reason is not None:
            if rank == 0:
                result["skipped"].append(f"{name}: skipped: {reason}")
                print(f"== {name}: skipped: {reason}", flush=True)
        elif rank < world:
            if rank == 0:
                print(f"== {name} ({world} process(es))", flush=True)
            os.environ.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[name]),
            )  # fmt: skip
            alarm = vt._Alarm(left) if args.time_budget else None
            try:
                init_distributed(acc, timeout=timedelta(seconds=150))
                try:
                    mine = run_phase(rank, world, acc, cfg, args, variant)
                except Exception as exc:
                    traceback.print_exc()
                    mine = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
                per_rank = gather(mine)
                if rank == 0:
                    entry = summarize(name, variant, world, per_rank, args.batch)
                    result["runs"].append(entry)
                    last_phase_s = entry.get("phase_s", last_phase_s)
                    if "error" in entry:
                        result["errors"].append(f"{name}: {entry['error']}")
                    else:
                        print(
                            f"   {entry['samples_per_s']:.1f} samples/s "
                            f"({entry['samples_per_s_per_gpu']:.1f}/GPU), median step "
                            f"{entry['median_step_s']:.4f}s, peak {entry['peak_mem_gb']:.1f} GB,"
                            f" step-0 loss {entry['losses'][0]:.4f}, phase "
                            f"{entry['phase_s']:.1f}s",
                            flush=True,
                        )
            except Exception as exc:
                traceback.print_exc()
                if rank == 0:
                    result["runs"].append({"name": name, "variant": variant, "gpus": world,
                                           "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
                    result["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            finally:
                if alarm is not None:
                    alarm.cancel()
                destroy_distributed()
                for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
                    os.environ.pop(key, None)
        if rank == 0:
            finish(result)
            result["wall_s"] = time.time() - t_start
            write(result, args)  # partial results survive a kill
        barrier.wait(timeout=wait_s)
    if rank == 0:
        print(header(result) + table(result), flush=True)


# ----------------------------------------------------------------------------- results


def table(result: dict[str, Any]) -> str:
    lines = [
        "| run | GPUs | samples/s total | samples/s per GPU | DP=2 / DP=1 | median step (s) "
        "| host step (s) | data wait (s) | MFU per GPU | peak mem per GPU (GB) | step-0 loss "
        "| same-step overlap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        if "samples_per_s" not in r:
            err = str(r.get("error", "?")).splitlines()[0][:90].replace("|", "/")
            lines.append(f"| {r['name']} | {r.get('gpus', '?')} | {err} | | | | | | | | | |")
            continue
        ratio = f"{r['scaling_vs_dp1']:.3f}x" if "scaling_vs_dp1" in r else "-"
        mem = ", ".join(f"{m:.1f}" for m in r["peak_mem_gb_per_gpu"])
        overlap = "-" if r["same_step_overlap"] is None else str(r["same_step_overlap"])
        lines.append(
            f"| {r['name']} | {r['gpus']} | {r['samples_per_s']:.1f} | "
            f"{r['samples_per_s_per_gpu']:.1f} | {ratio} | {r['median_step_s']:.4f} | "
            f"{r['host_step_s']:.4f} | {r['data_wait_s']:.4f} | {r['mfu_per_gpu']:.1%} | "
            f"{mem} | {r['losses'][0]:.4f} | {overlap} |"
        )
    for variant, check in result.get("checks", {}).items():
        lines.append(
            f"\n{variant}: DP=2 / DP=1 samples/s {result['dp_scaling'][variant]:.3f}x "
            f"(2.0 = linear); step-0 loss DP=2 (mean over ranks) "
            f"{check['step0_loss_dp2_mean_over_ranks']:.4f} vs DP=1 "
            f"{check['step0_loss_dp1']:.4f} ({check['step0_loss_rel_diff']:.1%}, "
            f"{'ok' if check['loss_in_range'] else 'OUT OF RANGE'} at <= {LOSS_RANGE:.0%}); "
            f"ranks read disjoint shards: {check['ranks_read_disjoint_shards']}, hold equal "
            f"weights after the run: {check['ranks_params_equal']}"
        )
    for line in result["skipped"] + result["errors"]:
        lines.append(f"- {line}")
    return "\n".join(lines)


def header(result: dict[str, Any]) -> str:
    cfg = result["config"]
    return (
        f"# vla_scaling {result['date']}\n\n{result['gpu']} x {result['gpus']}, commit "
        f"{result['commit']}, versions {json.dumps(result['versions'])}\n\n"
        f"GR00T-N1.6 ({cfg['flavor']}), batch {cfg['batch_per_gpu']} per GPU (weak scaling), "
        f"bf16, {cfg['workers']} loader workers per rank, {cfg['steps']} timed steps after "
        f"{cfg['warmup']} warm-up, backend {cfg['backend']}; the step is vla_throughput's "
        f"longboat run at DP rank r of 2 (product data parallelism). samples/s total: all "
        f"ranks' samples over the slowest rank's timed wall clock.\n\n"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = [r for r in result["runs"] if "samples_per_s" in r]
    if not runs:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    variants = [v for v in result["config"]["variants"] if any(r["variant"] == v for r in runs)]
    width = 0.38
    for k, world in enumerate((1, 2)):
        vals = [
            next((r["samples_per_s"] for r in runs if r["variant"] == v and r["gpus"] == world), 0)
            for v in variants
        ]
        a1.bar([i + (k - 0.5) * width for i in range(len(variants))], vals, width,
               label=f"DP={world}", color=("tab:blue", "tab:green")[k])  # fmt: skip
    for i, v in enumerate(variants):
        one = next((r for r in runs if r["variant"] == v and r["gpus"] == 1), None)
        if one:
            a1.hlines(2 * one["samples_per_s"], i - width, i + width, colors="gray",
                      linestyles="--", lw=0.8)  # fmt: skip
    a1.set_xticks(range(len(variants)), variants)
    a1.set_ylabel("samples/s total (dashed: 2x DP=1)")
    a1.legend()
    for r in runs:
        a2.plot(r["step_times_s"], label=r["name"], ls="-" if r["gpus"] == 1 else "--")
    a2.set_xlabel("timed step")
    a2.set_ylabel("device step time, rank 0 (s)")
    a2.legend(fontsize=7)
    cfg = result["config"]
    fig.suptitle(
        f"vla_scaling {result['date']} {result['gpu']}: GR00T-N1.6 {cfg['flavor']}, "
        f"batch {cfg['batch_per_gpu']}/GPU"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict[str, Any], args: argparse.Namespace) -> None:
    text = json.dumps(result, indent=2) + "\n"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.results_dir is None:
        return
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = results_stem(args.results_dir, result["date"], args.tiny)
    stem.with_suffix(".json").write_text(text)
    stem.with_suffix(".md").write_text(header(result) + table(result) + "\n")
    plot(result, stem.with_suffix(".png"))


def results_stem(results_dir: Path, date: str, tiny: bool) -> Path:
    return results_dir / f"vla_scaling_{date}{'_tiny' if tiny else ''}"


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, gloo on CPU (smoke)")
    p.add_argument("--batch", type=int, default=None, help="per GPU (default 32; tiny 2)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workers", type=int, default=None, help="loader workers per rank (8; tiny 0)")
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma list of {','.join(VARIANTS)} (default: all; tiny: longboat_master)",
    )
    p.add_argument("--time-budget", type=float, default=0, help="seconds for everything (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, default=None)
    # The dataset of run_h200.sh's vla throughput step: the same directory is reused.
    p.add_argument("--embodiments", type=int, default=8)
    p.add_argument("--episodes", type=int, default=6, help="episodes per embodiment")
    p.add_argument("--episode-length", type=int, nargs=2, default=[80, 120])
    p.add_argument(
        "--override",
        action="append",
        default=[],
        help="model config override KEY=JSON_VALUE (repeatable), e.g. dit.num_layers=2",
    )
    args = p.parse_args(argv)
    t_start = time.time()
    nprocs = 2
    if args.out is None and args.results_dir is None:
        p.error("give --out and/or --results-dir (where the results go)")
    if not args.tiny and (not torch.cuda.is_available() or torch.cuda.device_count() < nprocs):
        p.error(f"needs {nprocs} CUDA devices (use --tiny for the CPU smoke)")
    args.variants = args.variants or ("longboat_master" if args.tiny else ",".join(VARIANTS))
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; use {', '.join(VARIANTS)}")
    args.batch = args.batch or (2 if args.tiny else 32)
    args.workers = (0 if args.tiny else 8) if args.workers is None else args.workers
    if args.workers > 0:
        # As vla_throughput: untimed until the loader's first burst is consumed.
        args.warmup = max(args.warmup, args.workers + 1)
    args.overrides = key_values(args.override, "--override")

    from longboat.embodied.models import get_config

    flavor = "tiny" if args.tiny else "full"
    cfg = get_config(MODEL, flavor, args.overrides)
    hw = (56, 84) if args.tiny else (256, 256)
    args.flops = vt.flops_per_sample(cfg, 2, hw, text_len=TEXT_LEN)
    args.data_dir = args.data_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"vla_bench_{flavor}"
    t0 = time.time()
    vt.make_dataset(
        args.data_dir,
        embodiments=args.embodiments,
        episodes=args.episodes,
        length=tuple(args.episode_length),
        hw=hw,
        max_state=cfg.max_state_dim,
        max_action=cfg.max_action_dim,
    )
    print(f"dataset: {args.data_dir} ({time.time() - t0:.1f}s)", flush=True)
    meta: dict[str, Any] = {
        "benchmark": "vla_scaling",
        "date": DATE,
        "gpu": "cpu" if args.tiny else vt.gpu_name(),
        "gpus": nprocs,
        "versions": vt.versions("transformers", "av", "triton"),
        "commit": vt.git_commit(),
        "config": {
            "model": MODEL,
            "flavor": flavor,
            "overrides": args.overrides,
            "variants": args.variants,
            "batch_per_gpu": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "workers": args.workers,
            "precision": "bf16",
            "image_hw": list(hw),
            "cameras": 2,
            "embodiments": args.embodiments,
            "episodes_per_embodiment": args.episodes,
            "episode_length": args.episode_length,
            "backend": "gloo (cpu)" if args.tiny else "nccl",
            "flops_per_sample": args.flops,
            "peak_flops": vt.PEAK_BF16_FLOPS,
            "loss_range": LOSS_RANGE,
            "time_budget_s": args.time_budget,
            "dataset_s": time.time() - t0,
        },
        "runs": [],
        "skipped": [],
        "errors": [],
    }
    ports = {name: find_free_port() for name, _, _ in phase_names(args.variants)}
    codes, killed = run_workers(
        worker, nprocs, (ports, args, t_start, meta), time_budget=args.time_budget,
        t_start=t_start,
    )  # fmt: skip
    written = args.out or results_stem(args.results_dir, DATE, args.tiny).with_suffix(".json")
    if report_failure(codes, killed, written, table):
        return 1
    final = json.loads(written.read_text())
    ok = all("samples_per_s" in r for r in final["runs"]) and all(
        c["loss_in_range"] and c["ranks_read_disjoint_shards"] and c["ranks_params_equal"]
        for c in final["checks"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
