"""The memory plan against the measured peak: the embodied benchmarks' default shapes
(pi0.5 and GR00T-N1.6 at batch 32) with the CLI's defaults, planned vs measured.

    python tools/bench/memory_plan.py --out results.json [--models pi05,groot_n1_6]
        [--budgets auto,33] [--batch 32] [--steps 6] [--workers 8] [--tiny]
        [--results-dir DIR] [--time-budget S]

Each run is ``longboat-embodied train experiment=<model>_tiny model=<model>`` with the
throughput benchmark's overrides (``vla_throughput.longboat_overrides``: bf16, the batch, the
dataset, the byte-level prompts) and ``train.memory_budget=<budget>`` (``auto``: 90% of the
free device memory), trained for ``--warmup + --steps`` steps. Per run: what the plan chose
(``train.recompute``, the micro-batch), its predicted peak and its parts, every choice it
weighed with its prediction, the measured peak (the accelerator's peak allocated memory over
the build and the steps, the plan's own second line), how far the measurement is from the
prediction (target: within 10%; on the CPU the measured peak is the process's resident
memory, so no comparison is made) and samples/s. Writes ``<results-dir>/memory_plan_<date>
[_tiny].{json,md}`` and ``--out``; prints the table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import bench_env as env
from bench_env import failed_row, fmt, md_table
from bench_train import train_timed
from vla_throughput import EXPERIMENT, add_data_args, dataset_for, longboat_overrides

GB = float(1 << 30)
PEERS = ("triton",)


def plan_probe(training: Any) -> dict[str, Any]:
    """The run's plan: its choice, prediction and the options it weighed."""
    plan = training.memory_plan
    if isinstance(plan, str):  # no budget: nothing planned
        return {"plan_line": plan}
    c = plan.choice
    return {
        "plan_line": plan.line(),
        "choice": {"recompute": c.recompute, "micro_batch": c.micro_batch,
                   "moment_bytes": c.moment_bytes, "master_storage": c.master_storage,
                   "changes_numerics": list(plan.changes_numerics)},
        "predicted_gb": plan.estimate.total / GB,
        "predicted_parts_gb": {
            "states": plan.estimate.states.total / GB,
            "activations": plan.estimate.activations / GB,
            "workspace": (plan.estimate.workspace + plan.estimate.batch) / GB,
        },
        "budget_gb": plan.budget / GB if plan.budget else None,
        "options": [
            {"recompute": o.recompute, "micro_batch": o.micro_batch,
             "moment_bytes": o.moment_bytes, "master_storage": o.master_storage,
             "predicted_gb": e.total / GB}
            for o, e in plan.options
        ],
        "cuda_graph": bool(training.cfg.train.cuda_graph),
    }  # fmt: skip


def run_one(args: Any, model: str, budget: str, acc: Any) -> dict[str, Any]:
    """One model at one budget (module doc)."""
    from longboat.embodied.models import get_config

    args.model = model
    flavor = "tiny" if args.tiny else "full"
    cfg = get_config(model, flavor, args.overrides)
    hw = (56, 84) if args.tiny else (256, 256)
    root = dataset_for(args, cfg, hw)
    overrides = [*longboat_overrides(args, root), f"train.memory_budget={budget}"]
    r = train_timed("embodied", EXPERIMENT[model], overrides, acc, warmup=args.warmup,
                    steps=args.steps, probe=plan_probe)  # fmt: skip
    timing = r.pop("timing")
    s = timing.summary(r["items_per_step"])
    measured = r["peak_mem_gb"]
    predicted = r.get("predicted_gb")
    # the host's peak (RSS on the CPU) is no device memory: compared only on a device
    device = acc.memory_capacity() is not None
    off = (measured - predicted) / predicted if device and predicted and measured else None
    return {"name": f"{model} @ {budget}", "model": model, "budget": budget,
            "samples_per_s": s["window_items_per_s"], "median_step_s": s["median_step_s"],
            "measured_gb": measured, "off": off, **r}  # fmt: skip


def table(result: dict[str, Any]) -> str:
    header = ["run", "chose", "predicted (GB)", "measured (GB)", "off", "within 10%",
              "budget (GB)", "samples/s", "median step (s)"]  # fmt: skip
    rows = []
    for r in result["runs"]:
        if "measured_gb" not in r:
            rows.append(failed_row(r, len(header)))
            continue
        c = r.get("choice")
        chose = "no plan" if c is None else f"recompute={c['recompute']}, micro {c['micro_batch']}"
        if c and c.get("changes_numerics"):
            chose += f"; {', '.join(c['changes_numerics'])} (changes numerics)"
        off = r["off"]
        rows.append([r["name"], chose, fmt(r.get("predicted_gb"), ".2f"),
                     fmt(r["measured_gb"], ".2f"), "-" if off is None else f"{off:+.1%}",
                     "-" if off is None else ("yes" if abs(off) <= 0.10 else "no"),
                     fmt(r.get("budget_gb"), ".1f"), fmt(r["samples_per_s"], ".1f"),
                     fmt(r["median_step_s"])])  # fmt: skip
    return md_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", default="pi05,groot_n1_6")
    p.add_argument("--budgets", default="auto", help="comma list of train.memory_budget values")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (the graph capture)")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers")
    p.add_argument("--results-dir", type=Path, default=env.REPO / "benchmarks/results")
    p.add_argument("--time-budget", type=float, default=0, help="seconds for all runs (0: none)")
    add_data_args(p)
    args = p.parse_args(argv)
    args.overrides = env.key_values(args.override, "--override")
    from longboat.core.device import get_accelerator

    acc = get_accelerator()
    models = args.models.split(",")
    unknown = sorted(set(models) - set(EXPERIMENT))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; use some of {sorted(EXPERIMENT)}")
    budgets = args.budgets.split(",")
    config = {"models": models, "budgets": budgets, "batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "workers": args.workers, "tiny": args.tiny,
              "embodiments": args.embodiments, "episodes_per_embodiment": args.episodes,
              "episode_length": args.episode_length, "model_overrides": args.overrides}  # fmt: skip
    result = env.result_meta("memory_plan", acc.device_type != "cpu", PEERS, config)
    stem = f"memory_plan_{result['date']}" + ("_tiny" if args.tiny else "")
    runs = {f"{m} @ {b}": (m, b) for m in models for b in budgets}

    def write() -> None:
        env.write_results(result, out=args.out, results_dir=args.results_dir, stem=stem,
                          table=table(result), note=f"config: {config}")  # fmt: skip

    def say(r: dict[str, Any]) -> str:
        return (f"{r.get('plan_line', '')} measured {r['measured_gb']:.1f} GB "
                f"({r['samples_per_s']:.1f} samples/s)")  # fmt: skip

    env.run_all(list(runs), lambda name: run_one(args, *runs[name], acc), result, write,
                time_budget=args.time_budget, describe=say)  # fmt: skip
    write()
    print(f"\nmemory_plan {result['date']} {result['gpu']} commit {result['commit']} "
          f"(batch {args.batch})")  # fmt: skip
    print(table(result))
    return 0 if all("measured_gb" in r for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
