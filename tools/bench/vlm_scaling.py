"""VLM heterogeneous tensor parallelism on one host: ViT TP=1 + LLM TP=2 vs both TP=2.

    python tools/bench/vlm_scaling.py --results-dir DIR [--out results.json] [--tiny]
        [--steps 20] [--warmup 3] [--samples N] [--time-budget S]

Model and data: vlm_throughput's (Qwen2.5-VL-3B shapes; generated samples of four mixed-size
images and about 8,100 tokens, one packed row a step; ``--tiny``: a CPU-sized model). The
parent saves one seeded HF ``Qwen2_5_VLForConditionalGeneration`` of those shapes with the
benchmark tokenizer's token ids (``vlm_reference.hf_qwen2_5_vl``, bf16), so both phases start
from the same weights (a tower sharded over TP and an unsharded one draw different random
inits). Both phases are ``longboat-vlm train experiment=sft`` (``build_training`` + ``Trainer``)
with vlm_throughput's keys plus ``model.init_from`` and ``parallel.tensor_parallel=2``, in two
processes (``bench_procs``: one per GPU, NCCL; gloo on CPU with ``--tiny``), data parallel 1, the
same rows in the same order:

- ``tp2``: ``model.vision_tensor_parallel`` null, the CLI's default (the tower shares the
  decoder's TP).
- ``tp2_vit1``: ``model.vision_tensor_parallel=1`` (the tower unsharded, each TP rank encoding
  its share of the images by ViT cost, the embeddings exchanged).

Per phase: tokens/s (a sample's mean real tokens over rank 0's median device step), MFU per GPU,
every rank's peak memory, the loss curve. The checks: tp2_vit1 / tp2 tokens/s (target: > 1,
faster) and the per-step relative loss difference (equal within ``LOSS_REL_TOL`` at bf16;
the measured max and mean are reported either way). Writes
``<results-dir>/vlm_scaling_<date>[_tiny].{json,md,png}`` (and ``--out``) after every phase.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_env as env
import torch
import vlm_throughput as vt
from baselines import vlm_reference as ref
from bench_align import curve_check, curve_check_line
from bench_env import failed_row, fmt, md_table
from bench_procs import preflight, run_phases
from bench_train import compose, train_timed

PHASES = [("tp2", 2), ("tp2_vit1", 2)]
PHASE_KEYS = {"tp2": [], "tp2_vit1": ["model.vision_tensor_parallel=1"]}
"""Keys each phase adds to vlm_throughput's, ``model.init_from`` and TP=2."""
LOSS_REL_TOL = 1e-3


def phase_overrides(base: list[str], name: str, hf_dir: str) -> list[str]:
    return [*base, f"model.init_from={hf_dir}", "parallel.tensor_parallel=2", *PHASE_KEYS[name]]


def run_phase(rank: int, world: int, name: str, args: Any) -> dict[str, Any]:
    """This rank's numbers of one phase."""
    from longboat.core.device import get_accelerator

    def probe(training: Any) -> dict[str, Any]:
        return {"precision": training.precision, "describe": training.describe()}

    ov = phase_overrides(args.base, name, args.hf_dir)
    r = train_timed("vlm", vt.EXPERIMENT, ov, get_accelerator(), warmup=args.warmup,
                    steps=args.steps, probe=probe)  # fmt: skip
    return vt.entry(name, r, args.tokens, args.flops)


def summarize(name: str, world: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r0, mem = per_rank[0], [r["peak_mem_gb"] for r in per_rank]
    # The TP ranks end every step with the same collectives: rank 0's step time is the step's.
    return {**{k: v for k, v in r0.items() if k not in ("rank", "mfu")}, "gpus": world,
            "tokens_per_s_per_gpu": r0["tokens_per_s"] / world, "mfu_per_gpu": r0["mfu"] / world,
            "peak_mem_gb_per_gpu": mem, "peak_mem_gb": max(mem),
            "median_step_s_per_rank": [r["median_step_s"] for r in per_rank]}  # fmt: skip


def finish(result: dict[str, Any]) -> None:
    runs = {r["name"]: r for r in result["runs"] if "tokens_per_s" in r}
    if not ("tp2" in runs and "tp2_vit1" in runs):
        return
    base, het = runs["tp2"], runs["tp2_vit1"]
    ratio = het["tokens_per_s"] / base["tokens_per_s"]
    het["speedup_vs_tp2"] = result["hetero_speedup"] = ratio
    result["hetero_faster"] = ratio > 1.0
    a, b = base["losses"], het["losses"]
    c = result["loss_check"] = curve_check(a, b, LOSS_REL_TOL)
    result["max_rel_loss_diff"] = c["max_rel_loss_diff"]


def table(result: dict[str, Any]) -> str:
    header = ["run", "GPUs", "ViT TP", "tokens/s", "vs tp2", "MFU per GPU",
              "peak mem per GPU (GB)", "median step (s)", "first / last loss"]  # fmt: skip
    rows = []
    for r in result["runs"]:
        if "tokens_per_s" not in r:
            rows.append(failed_row(r, len(header)))
            continue
        vit = "1" if PHASE_KEYS[r["name"]] else "2 (decoder's)"
        rows.append([r["name"], str(r["gpus"]), vit, fmt(r["tokens_per_s"], ".2f", 1e-3, "k"),
                     fmt(r.get("speedup_vs_tp2"), ".3f", suffix="x"), fmt(r["mfu_per_gpu"], ".1%"),
                     ", ".join(f"{m:.1f}" for m in r["peak_mem_gb_per_gpu"]),
                     fmt(r["median_step_s"], ".4f"),
                     f"{r['losses'][0]:.4f} / {r['losses'][-1]:.4f}"])  # fmt: skip
    lines = [md_table(header, rows)]
    lines += [f"- {line}" for line in result["skipped"] + result["errors"]]
    c = result.get("loss_check")
    if c:
        lines.append(
            f"\n{curve_check_line(c)}"
            f"\nViT TP=1 + LLM TP=2 / both TP=2 tokens/s: {result['hetero_speedup']:.3f}x"
        )  # fmt: skip
    return "\n".join(lines)


def write(result: dict[str, Any], args: Any) -> None:
    finish(result)
    runs = [r for r in result["runs"] if "tokens_per_s" in r]
    title = f"vlm_scaling {result['date']} {result['gpu']}: {result['config']['model']}, TP=2"
    names = [r["name"] for r in runs]
    panels = [([r["tokens_per_s"] / 1e3 for r in runs], "tokens/s (thousands)"),
              ([r["peak_mem_gb"] for r in runs], "peak memory per GPU (GB)")]  # fmt: skip
    plot = lambda plt: runs and env.bar_chart(plt, title, names, panels)  # noqa: E731
    stem = f"vlm_scaling_{result['date']}{'_tiny' if args.tiny else ''}"
    env.write_results(result, out=args.out, results_dir=args.results_dir, stem=stem,
                      table=table(result), plot=plot)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, gloo on CPU (smoke)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--samples", type=int, default=0, help="generated samples (0: the shape's)")
    p.add_argument("--time-budget", type=float, default=0, help="seconds for everything (0: none)")
    p.add_argument("--seed", type=int, default=0, help="the data and the HF model's init")
    args = p.parse_args(argv)
    t_start = time.time()
    preflight(p, args, "longboat.vlm.train.training")
    c = dict(vt.TINY if args.tiny else vt.FULL)
    c["samples"] = args.samples or c["samples"]
    with tempfile.TemporaryDirectory(prefix="vlm_scaling_") as tmp:
        data, tok = vt.make_data(Path(tmp), c, args.seed)
        args.base = vt.overrides(c, data, tok)
        cfg = compose("vlm", vt.EXPERIMENT, args.base, str(Path(tmp) / "run"))
        model_cfg, rows, args.tokens, args.flops = vt.measure_rows(cfg)
        args.hf_dir = str(Path(tmp) / "hf")
        torch.manual_seed(args.seed)
        ref.hf_qwen2_5_vl(model_cfg, torch.device("cpu")).to(torch.bfloat16).save_pretrained(args.hf_dir)  # fmt: skip
        shown = [o for o in args.base if not o.startswith(("data.paths", "data.tok"))]
        config = {**{k: v for k, v in c.items() if k not in ("images", "px")},
                  "images": [list(x) for x in c["images"]], "rows": len(rows),
                  "mean_tokens": args.tokens, "flops_per_sample": args.flops,
                  "overrides": {n: phase_overrides(shown, n, "<hf dir>") for n, _ in PHASES},
                  "steps": args.steps, "warmup": args.warmup, "loss_rel_tol": LOSS_REL_TOL,
                  "init": "one seeded HF Qwen2_5_VLForConditionalGeneration, saved in bf16",
                  "backend": "gloo (cpu)" if args.tiny else "nccl",
                  "peak_flops": env.PEAK_BF16_FLOPS, "time_budget_s": args.time_budget}  # fmt: skip
        result = env.result_meta("vlm_scaling", not args.tiny, vt.PEERS, config)
        result.update(gpus=2, skipped=[], errors=[])
        run_phases(PHASES, run_phase, (args,), summarize, result, lambda: write(result, args),
                   cpu=args.tiny, time_budget=args.time_budget, t_start=t_start,
                   phase_s=20.0 if args.tiny else 120.0)  # fmt: skip
    print(table(result), flush=True)
    ok = not result["errors"] and result.get("loss_check", {}).get("equal", False)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
