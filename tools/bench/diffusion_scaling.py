"""Wan context parallelism on one host: ``longboat-diffusion train`` at CP=2 on two GPUs vs one.

    python tools/bench/diffusion_scaling.py --results-dir DIR [--out results.json] [--tiny]
        [--frames 81] [--steps 20] [--warmup 3] [--samples N] [--keys KEY=VALUE ...]
        [--time-budget S]

Model and data: diffusion_throughput's (Wan2.1 T2V-1.3B shapes, one seeded diffusers
``WanTransformer3DModel`` saved once, read by both phases through ``model.init_from``; random
latents at 480x832, 81 frames by default: 16x21x60x104 = 32,760 tokens, 512 text tokens;
``--tiny``: a 2-block Wan with a few tokens). Both phases are ``longboat-diffusion train
experiment=finetune`` with diffusion_throughput's keys (the benchmark's weights and data,
unshuffled, global batch 1) and ``--keys``, the same samples in the same order:

- ``cp1``: one process (one GPU).
- ``cp2``: ``parallel.context_parallel=2`` on two processes (``bench_procs``: one per GPU, NCCL;
  gloo on CPU with ``--tiny``): Ulysses over the video tokens, each rank running the blocks on
  half of them, data parallel 1. Both ranks train the same sample each step.

Per phase: video tokens/s and samples/s (rank 0's median device step), MFU per GPU, every
rank's peak memory, the loss curve. The checks: cp2 / cp1 tokens/s (target ``TARGET``) and the
per-step relative loss difference (equal within ``LOSS_REL_TOL`` at bf16: a step's noise is
the same on both layouts and CP only splits the work; the measured max and mean are reported
either way). Writes ``<results-dir>/diffusion_scaling_<date>[_tiny].{json,md,png}`` (and
``--out``) after every phase.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_env as env
import diffusion_throughput as dt
from bench_align import curve_check, curve_check_line
from bench_env import failed_row, fmt, md_table
from bench_procs import preflight, run_phases
from bench_train import train_timed

PHASES = [("cp1", 1), ("cp2", 2)]
PHASE_KEYS = {"cp1": [], "cp2": ["parallel.context_parallel=2"]}
"""Keys each phase adds to diffusion_throughput's and ``--keys``."""
LOSS_REL_TOL = 1e-3
TARGET = 1.7
"""cp2 / cp1 tokens/s the scaling row asks for."""


def run_phase(rank: int, world: int, name: str, args: Any) -> dict[str, Any]:
    """This rank's numbers of one phase."""
    from longboat.core.device import get_accelerator

    def probe(training: Any) -> dict[str, Any]:
        return {"precision": training.precision, "describe": training.describe(),
                "context_parallel": training.layout.context_parallel}  # fmt: skip

    overrides = [*args.base, *args.keys, *PHASE_KEYS[name]]
    r = train_timed("diffusion", dt.EXPERIMENT, overrides, get_accelerator(),
                    warmup=args.warmup, steps=args.steps, probe=probe)  # fmt: skip
    return {**dt.entry(name, args.frames, r, args.tokens, args.flops), "rank": rank}


def summarize(name: str, world: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r0, mem = per_rank[0], [r["peak_mem_gb"] for r in per_rank]
    # The CP ranks end every step with the same collectives: rank 0's step time is the step's.
    return {**{k: v for k, v in r0.items() if k not in ("rank", "mfu")}, "gpus": world,
            "mfu_per_gpu": r0["mfu"] / world, "peak_mem_gb_per_gpu": mem, "peak_mem_gb": max(mem),
            "median_step_s_per_rank": [r["median_step_s"] for r in per_rank],
            "losses_per_rank_equal": all(r["losses"] == r0["losses"] for r in per_rank)}  # fmt: skip


def finish(result: dict[str, Any]) -> None:
    runs = {r["name"]: r for r in result["runs"] if "tokens_per_s" in r}
    if not ("cp1" in runs and "cp2" in runs):
        return
    one, two = runs["cp1"], runs["cp2"]
    ratio = two["tokens_per_s"] / one["tokens_per_s"]
    two["speedup_vs_cp1"] = result["cp2_speedup"] = ratio
    result["meets_target"] = ratio >= TARGET
    a, b = one["losses"], two["losses"]
    c = result["loss_check"] = curve_check(a, b, LOSS_REL_TOL)
    result["max_rel_loss_diff"] = c["max_rel_loss_diff"]


def table(result: dict[str, Any]) -> str:
    header = ["run", "GPUs", "CP", "tokens/s", "samples/s", "vs cp1", "MFU per GPU",
              "peak mem per GPU (GB)", "median step (s)", "first / last loss"]  # fmt: skip
    rows = []
    for r in result["runs"]:
        if "tokens_per_s" not in r:
            rows.append(failed_row(r, len(header)))
            continue
        rows.append([r["name"], str(r["gpus"]), str(r["context_parallel"]),
                     fmt(r["tokens_per_s"], ".2f", 1e-3, "k"), fmt(r["samples_per_s"], ".3f"),
                     fmt(r.get("speedup_vs_cp1"), ".3f", suffix="x"), fmt(r["mfu_per_gpu"], ".1%"),
                     ", ".join(f"{m:.1f}" for m in r["peak_mem_gb_per_gpu"]),
                     fmt(r["median_step_s"], ".4f"),
                     f"{r['losses'][0]:.5f} / {r['losses'][-1]:.5f}"])  # fmt: skip
    lines = [md_table(header, rows)]
    lines += [f"- {line}" for line in result["skipped"] + result["errors"]]
    c = result.get("loss_check")
    if c:
        lines.append(
            f"\n{curve_check_line(c)}"
            f"\nCP=2 on two GPUs / one GPU tokens/s: {result['cp2_speedup']:.3f}x "
            f"(target >= {TARGET:g}x)"
        )  # fmt: skip
    return "\n".join(lines)


def write(result: dict[str, Any], args: Any) -> None:
    finish(result)
    runs = [r for r in result["runs"] if "tokens_per_s" in r]
    title = (f"diffusion_scaling {result['date']} {result['gpu']}: {result['config']['model']}, "
             f"{args.frames} frames")  # fmt: skip
    names = [r["name"] for r in runs]
    panels = [([r["tokens_per_s"] / 1e3 for r in runs], "video tokens/s (thousands)"),
              ([r["peak_mem_gb"] for r in runs], "peak memory per GPU (GB)")]  # fmt: skip
    plot = lambda plt: runs and env.bar_chart(plt, title, names, panels)  # noqa: E731
    stem = f"diffusion_scaling_{result['date']}{'_tiny' if args.tiny else ''}"
    env.write_results(result, out=args.out, results_dir=args.results_dir, stem=stem,
                      table=table(result), plot=plot)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, gloo on CPU (smoke)")
    p.add_argument("--frames", type=int, default=0, help="video frames (0: 81; --tiny: 9)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--samples", type=int, default=0, help="generated samples (0: the shape's)")
    p.add_argument("--keys", nargs="*", default=[], help="config keys both phases add, e.g. "
                   "train.recompute=selective (a variant: not the CLI's defaults)")  # fmt: skip
    p.add_argument("--time-budget", type=float, default=0, help="seconds for everything (0: none)")
    p.add_argument("--seed", type=int, default=0, help="weights and data")
    args = p.parse_args(argv)
    t_start = time.time()
    preflight(p, args, "longboat.diffusion.train.training")
    c = dict(dt.TINY if args.tiny else dt.FULL)
    c["samples"] = args.samples or c["samples"]
    args.frames = args.frames or (9 if args.tiny else 81)
    shape = dt.latent_shape(args.frames, c["latent_hw"])
    arch = c["arch"]
    args.tokens = dt.video_tokens(shape, arch["patch_size"])
    args.flops = dt.flops_per_sample(arch, args.tokens, c["text_len"])
    with tempfile.TemporaryDirectory(prefix="diffusion_scaling_") as tmp:
        weights, _ = dt.make_weights(Path(tmp) / "weights", arch, args.seed)
        dt.make_data(Path(tmp) / "data", c, args.frames, args.seed)
        args.base = dt.overrides(weights, Path(tmp) / "data")
        shown = [o for o in args.base if not o.startswith(("model.init", "data.paths"))]
        config = {"model": c["model"], "arch": arch, "frames": args.frames,
                  "latent_shape": [arch["in_channels"], *shape], "video_tokens": args.tokens,
                  "text_tokens": c["text_len"], "samples": c["samples"],
                  "flops_per_sample": args.flops,
                  "overrides": {n: [*shown, *args.keys, *PHASE_KEYS[n]] for n, _ in PHASES},
                  "steps": args.steps, "warmup": args.warmup, "loss_rel_tol": LOSS_REL_TOL,
                  "target_speedup": TARGET, "cli_defaults": not args.keys,
                  "init": "one seeded diffusers WanTransformer3DModel (fp32), via model.init_from",
                  "backend": "gloo (cpu)" if args.tiny else "nccl",
                  "peak_flops": env.PEAK_BF16_FLOPS, "time_budget_s": args.time_budget}  # fmt: skip
        result = env.result_meta("diffusion_scaling", not args.tiny, dt.PEERS, config)
        result.update(gpus=2, skipped=[], errors=[])
        run_phases(PHASES, run_phase, (args,), summarize, result, lambda: write(result, args),
                   cpu=args.tiny, time_budget=args.time_budget, t_start=t_start,
                   phase_s=20.0 if args.tiny else 180.0)  # fmt: skip
    print(table(result), flush=True)
    ok = not result["errors"] and result.get("loss_check", {}).get("equal", False)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
