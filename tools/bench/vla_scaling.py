"""VLA data-parallel scaling on one host: GR00T-N1.6 training at DP=2 vs DP=1 (weak scaling).

    python tools/bench/vla_scaling.py --results-dir DIR [--out x.json] [--tiny] [--steps 20]
        [--warmup 5] [--batch 32] [--workers 8] [--time-budget S]
        [--variants longboat,longboat_fsdp,longboat_graphed,longboat_master]

Each variant is vla_throughput's longboat run (``build_training`` + ``Trainer`` with the keys of
``vla_throughput.VARIANTS``) as ``<variant>_dp1`` (one process) and ``<variant>_dp2`` (one process
per GPU; NCCL, gloo on CPU with ``--tiny``), each rank with batch ``--batch``. Each worker sets
torchrun's variables and ``build_training`` joins the group: the data parallelism is the
product's own (each rank its shard of every global batch, its own draws, the strategy's
gradient reduction). The default variants: ``longboat`` (the CLI's defaults: DDP) and
``longboat_fsdp`` (``parallel.strategy=fsdp``: FSDP2, every block and the root sharded); the
target: DP=2 / DP=1 samples/s >= 1.90 for each.

Per run: samples/s total (the global batch over the slowest rank's timed wall clock) and per GPU,
the DP=2 / DP=1 ratio (2.0 = linear), rank 0's median device step, host step and batch wait,
every rank's peak memory, MFU per GPU. Checks: DP=2's step-0 loss (mean over the ranks) is finite
and within ``LOSS_RANGE`` of DP=1's; the ranks read disjoint samples every step (the run's
``GlobalBatchPlan``), rank 0 of DP=2 DP=1's first ones; every rank ends with the same weights
(float64 sum and sum of squares of the full parameters, sharded ones gathered; compared
exactly). Writes ``<results-dir>/vla_scaling_<date>[_<variants>][_tiny].{json,md,png}`` (the
variants' short names when not the default set) and ``--out`` after every phase.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import bench_env as env
import torch
import vla_throughput as vt
from bench_env import failed_row, fmt, md_table
from bench_procs import preflight, run_phases

MODEL = "groot_n1_6"
VARIANTS = ("longboat", "longboat_fsdp", "longboat_graphed", "longboat_master")
DEFAULT_VARIANTS = ("longboat", "longboat_fsdp")
DP_SCALING_TARGET = 1.9
LOSS_RANGE = 0.25
"""DP=2's step-0 loss must lie within this relative distance of DP=1's."""


def phases(variants: list[str]) -> list[tuple[str, int]]:
    return [(f"{v}_dp{w}", w) for v in variants for w in (1, 2)]


@torch.no_grad()
def params_checksum(optimizer: torch.optim.Optimizer) -> list[float]:
    """Sum and sum of squares (float64) of the trained parameters; a sharded (FSDP2) one is
    gathered first (a collective: every rank calls this)."""
    from torch.distributed.tensor import DTensor

    total = squares = 0.0
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        full = (p.full_tensor() if isinstance(p, DTensor) else p).double()
        total, squares = total + float(full.sum()), squares + float(full.square().sum())
    return [total, squares]


def sharded_params(optimizer: torch.optim.Optimizer) -> int:
    """How many trained parameters are sharded over the ranks (FSDP2's DTensors)."""
    from torch.distributed.tensor import DTensor

    return sum(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])


def same_step_overlap(samples: list[list[list[int]]]) -> int:
    """Samples that two ranks both trained on in the same step (0: disjoint shards)."""
    pairs = [(one, other) for r, one in enumerate(samples) for other in samples[r + 1 :]]
    return sum(len(set(a) & set(b)) for one, other in pairs for a, b in zip(one, other))


def run_phase(rank: int, world: int, name: str, args: Any) -> dict[str, Any]:
    """This rank's numbers of one phase (``vla_throughput.run_longboat_variant``)."""
    from longboat.core.device import get_accelerator

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    def probe(training: Any) -> dict[str, Any]:
        plan, accum, steps = training.data.plan, training.layout.accum, args.warmup + args.steps + 1
        samples = [[i for a in range(accum) for i in plan.micro_batch_indices(s, rank * accum + a)]
                   for s in range(steps)]  # fmt: skip
        return {"samples": samples, "params_checksum": params_checksum(training.optimizer),
                "sharded_params": sharded_params(training.optimizer),
                "strategy": training.cfg.parallel.strategy}  # fmt: skip

    variant = name.rsplit("_", 1)[0]
    r = vt.run_longboat_variant(variant, args, args.data_dir, get_accelerator(), world=world, probe=probe)  # fmt: skip
    return vt.entry(name, MODEL, r, args.flops)


def summarize(name: str, world: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One run from every rank's numbers: samples/s over the slowest rank's window."""
    r0, samples = per_rank[0], [r["samples"] for r in per_rank]
    total = r0["items_per_step"] * r0["timed_steps"] / max(r["window_s"] for r in per_rank)
    each = {k: [r[k] for r in per_rank] for k in ("median_step_s", "window_s", "params_checksum")}
    return {
        "name": name, "variant": name.rsplit("_", 1)[0], "gpus": world,
        "batch_per_gpu": r0["items_per_step"] // world, "global_batch": r0["items_per_step"],
        "samples_per_s": total, "samples_per_s_per_gpu": total / world,
        "mfu_per_gpu": total / world * r0["mfu"] / r0["samples_per_s"],
        **{k: r0[k] for k in ("median_step_s", "step_times_s", "host_step_s", "timed_steps",
                              "timing", "losses", "params", "notes")},
        "data_wait_s": max(r["data_wait_s"] for r in per_rank),
        "peak_mem_gb_per_gpu": [r["peak_mem_gb"] for r in per_rank],
        "peak_mem_gb": max(r["peak_mem_gb"] for r in per_rank),
        **{f"{k}_per_rank": v for k, v in each.items()},
        "step0_samples_per_rank": [s[0] for s in samples], "strategy": r0["strategy"],
        "sharded_params_per_rank": [r["sharded_params"] for r in per_rank],
        "same_step_overlap": same_step_overlap(samples) if world > 1 else None,
    }  # fmt: skip


def finish(result: dict[str, Any]) -> None:
    """DP=2 / DP=1 ratios, the loss check and the shard checks, per variant."""
    runs = {r["name"]: r for r in result["runs"] if "samples_per_s" in r}
    result["dp_scaling"], result["checks"] = {}, {}
    for variant in result["config"]["variants"]:
        one, two = runs.get(f"{variant}_dp1"), runs.get(f"{variant}_dp2")
        if not (one and two):
            continue
        ratio = two["samples_per_s"] / one["samples_per_s"]
        two["scaling_vs_dp1"], two["scaling_efficiency"] = ratio, ratio / two["gpus"]
        result["dp_scaling"][variant] = ratio
        result.setdefault("dp_scaling_meets_target", {})[variant] = ratio >= DP_SCALING_TARGET
        l1, l2 = one["losses"][0], two["losses"][0]
        rel = abs(l2 - l1) / abs(l1) if l1 else math.inf
        sums = two["params_checksum_per_rank"]
        result["checks"][variant] = {
            "step0_loss_dp1": l1,
            "step0_loss_dp2_mean_over_ranks": l2,
            "step0_loss_rel_diff": rel,
            "loss_in_range": math.isfinite(l2) and rel <= LOSS_RANGE,
            "ranks_read_disjoint_shards": two["same_step_overlap"] == 0,
            "ranks_params_equal": all(c == sums[0] for c in sums),
            "dp2_rank0_reads_dp1_samples": two["step0_samples_per_rank"][0]
            == one["step0_samples_per_rank"][0],
        }


def table(result: dict[str, Any]) -> str:
    header = ["run", "GPUs", "samples/s total", "samples/s per GPU", "DP=2 / DP=1",
              "median step (s)", "host step (s)", "data wait (s)", "MFU per GPU",
              "peak mem per GPU (GB)", "step-0 loss", "same-step overlap"]  # fmt: skip
    rows = []
    for r in result["runs"]:
        if "samples_per_s" not in r:
            rows.append(failed_row(r, len(header)))
            continue
        ratio = fmt(r.get("scaling_vs_dp1"), ".3f", suffix="x")
        rows.append([r["name"], str(r["gpus"]), fmt(r["samples_per_s"], ".1f"),
                     fmt(r["samples_per_s_per_gpu"], ".1f"), ratio,
                     fmt(r["median_step_s"], ".4f"), fmt(r["host_step_s"], ".4f"),
                     fmt(r["data_wait_s"], ".4f"), fmt(r["mfu_per_gpu"], ".1%"),
                     ", ".join(f"{m:.1f}" for m in r["peak_mem_gb_per_gpu"]),
                     fmt(r["losses"][0], ".4f"), fmt(r["same_step_overlap"], "d")])  # fmt: skip
    lines = [md_table(header, rows)]
    for variant, c in result.get("checks", {}).items():
        lines.append(
            f"\n{variant}: DP=2 / DP=1 samples/s {result['dp_scaling'][variant]:.3f}x "
            f"(2.0 = linear, target >= {DP_SCALING_TARGET}); "
            f"step-0 loss DP=2 (mean over ranks) {c['step0_loss_dp2_mean_over_ranks']:.4f} vs DP=1 "
            f"{c['step0_loss_dp1']:.4f} ({c['step0_loss_rel_diff']:.1%}, "
            f"{'ok' if c['loss_in_range'] else 'OUT OF RANGE'} at <= {LOSS_RANGE:.0%}); ranks read "
            f"disjoint shards: {c['ranks_read_disjoint_shards']}, hold equal weights after the "
            f"run: {c['ranks_params_equal']}"
        )  # fmt: skip
    lines += [f"- {line}" for line in result["skipped"] + result["errors"]]
    return "\n".join(lines)


def write(result: dict[str, Any], args: Any) -> None:
    finish(result)
    runs = [r for r in result["runs"] if "samples_per_s" in r]
    title = (f"vla_scaling {result['date']} {result['gpu']}: GR00T-N1.6 "
             f"{result['config']['flavor']}, batch {args.batch}/GPU")  # fmt: skip
    panels = [([r["samples_per_s"] for r in runs], "samples/s total"),
              ([r["median_step_s"] for r in runs], "median device step, rank 0 (s)")]  # fmt: skip
    stem = f"vla_scaling_{result['date']}{variants_tag(args.variants, args.tiny)}"
    names = [r["name"] for r in runs]
    plot = lambda plt: runs and env.bar_chart(plt, title, names, panels)  # noqa: E731
    md = table(result)
    env.write_results(
        result, out=args.out, results_dir=args.results_dir, stem=stem, table=md, plot=plot
    )


def variants_tag(variants: list[str], tiny: bool) -> str:
    """The results' name suffix: the variants' short names (``longboat`` is ``default``) unless
    they are the default set (tiny: ``longboat_master``), then ``_tiny`` for ``--tiny``."""
    default = ["longboat_master"] if tiny else list(DEFAULT_VARIANTS)
    short = [v.removeprefix("longboat_") if v != "longboat" else "default" for v in variants]
    return ("" if variants == default else "_" + "_".join(short)) + ("_tiny" if tiny else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--batch", type=int, default=None, help="per GPU (default 32; tiny 2)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workers", type=int, default=None, help="loader workers per rank (8; tiny 0)")
    p.add_argument("--variants", default=None, help=f"comma list of {','.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)}; tiny: longboat_master)")  # fmt: skip
    p.add_argument("--time-budget", type=float, default=0, help="seconds for everything (0: none)")
    vt.add_data_args(p)
    p.set_defaults(embodiments=8, episodes=6)  # run_all.sh's vla throughput dataset, reused
    args = p.parse_args(argv)
    t_start = time.time()
    from longboat.embodied.models import get_config

    preflight(p, args, "longboat.embodied.train.training")
    args.variants = (args.variants or ("longboat_master" if args.tiny else ",".join(DEFAULT_VARIANTS))).split(",")  # fmt: skip
    if bad := [v for v in args.variants if v not in VARIANTS]:
        p.error(f"--variants: unknown {bad}; use {', '.join(VARIANTS)}")
    args.batch = args.batch or (2 if args.tiny else 32)
    args.workers = (0 if args.tiny else 8) if args.workers is None else args.workers
    args.warmup = max(args.warmup, args.workers + 1, 1)  # as vla_throughput
    args.model, args.profile_steps, args.profile_dir = MODEL, 0, None
    args.overrides = env.key_values(args.override, "--override")
    flavor, hw = ("tiny", (56, 84)) if args.tiny else ("full", (256, 256))
    cfg = get_config(MODEL, flavor, args.overrides)
    args.flops = vt.flops_per_sample(MODEL, cfg, 2, hw)
    args.data_dir = vt.dataset_for(args, cfg, hw)
    config = {"model": MODEL, "flavor": flavor, "variants": args.variants,
              "longboat_overrides": vt.longboat_overrides(args, args.data_dir, 2),
              "batch_per_gpu": args.batch, "steps": args.steps, "warmup": args.warmup,
              "workers": args.workers, "precision": "bf16", "image_hw": list(hw),
              "backend": "gloo (cpu)" if args.tiny else "nccl", "flops_per_sample": args.flops,
              "peak_flops": env.PEAK_BF16_FLOPS, "loss_range": LOSS_RANGE,
              "dp_scaling_target": DP_SCALING_TARGET,
              "variant_keys": {v: vt.VARIANTS[v] for v in args.variants},
              "time_budget_s": args.time_budget}  # fmt: skip
    result = env.result_meta("vla_scaling", not args.tiny, vt.PEERS, config)
    result.update(gpus=2, skipped=[], errors=[])
    run_phases(phases(args.variants), run_phase, (args,), summarize, result, lambda: write(result, args),
               cpu=args.tiny, time_budget=args.time_budget, t_start=t_start,
               phase_s=15.0 if args.tiny else 45.0)  # fmt: skip
    print(table(result), flush=True)
    ok = all("samples_per_s" in r for r in result["runs"]) and all(
        c["loss_in_range"] and c["ranks_read_disjoint_shards"] and c["ranks_params_equal"]
        for c in result["checks"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
