"""LLM scaling on one host: DP=2 vs DP=1 tokens/s, TP=2 vs TP=1 loss curve and tokens/s.

    python tools/bench/llm_scaling.py --results-dir DIR [--out results.json] [--tiny]
        [--phases dp,tp] [--steps 20] [--warmup 5] [--tp-shape 886m|qwen3_1_7b]
        [--tp-steps 50] [--tp-micro-batch N] [--tp-band llm_loss_alignment.json]
        [--time-budget S]

Every phase is ``longboat-llm train`` (``build_training`` + ``Trainer``) in its own processes, one
per GPU, with torchrun's variables and the process group set up (``bench_procs``; gloo on CPU
with ``--tiny``), so the parallelism is the product's own:

1. ``dp1`` / ``dp2``: llm_throughput's ``longboat`` run on one rank, then two, each its own
   micro-batch 8 (weak scaling), megatron DDP + distributed optimizer as the CLI sets them up.
2. ``tp1`` / ``tp2``: llm_loss_alignment's ``longboat`` run of ``--tp-shape`` (one seeded HF
   model saved by the parent: ``LlamaForCausalLM`` for 886m, ``Qwen3ForCausalLM`` for
   qwen3_1_7b; the quickstart text) at ``parallel.tensor_parallel=1`` and ``2`` for
   ``--tp-steps`` steps on the same batches (micro-batch ``--tp-micro-batch``: 4 for 886m, 2
   for qwen3_1_7b, as the committed alignment of that shape): max and mean
   |loss_TP2 - loss_TP1| per step (TP=2 takes megatron's vocab-parallel cross-entropy where
   TP=1 fuses it, the product's choice), and both runs' tokens/s over steps 2 .. N-1. With
   ``--tp-band`` (an ``llm_loss_alignment`` result of the same shape, seed and micro-batch) the
   TP=2 - TP=1 differences are judged against that file's noise band (HF against itself with
   the rows of each batch reversed) over the same first N steps, by ``bench_align``'s rule.

Per throughput run: rank 0's median device step, tokens/s total and per GPU, MFU per GPU, every
rank's peak memory. Writes ``<results-dir>/llm_scaling[_<phases>][_<tp shape>]_<date>[_tiny]
.{json,md,png}`` (the phases' names when not both, the TP shape when not 886m; and ``--out``)
after every phase.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_align
import bench_env as env
import llm_loss_alignment as la
import llm_throughput as lt
import torch
from baselines import llm_reference as ref
from bench_env import failed_row, fmt, md_table
from bench_procs import preflight, run_phases
from bench_train import compose, train_timed

DP_SCALING_TARGET = 1.9
PHASES = {"dp": (("dp1", 1), ("dp2", 2)), "tp": (("tp1", 1), ("tp2", 2))}
TP_MICRO_BATCH = {"886m": 4, "qwen3_1_7b": 2}
"""The TP phases' micro-batch per shape (qwen3_1_7b: the committed alignment's, 2)."""
BAND_KEYS = ("family", "vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "seq",
             "micro_batch", "tie")  # fmt: skip
"""What a ``--tp-band`` file's config must share with the TP phases (and the seed)."""


def run_phase(rank: int, world: int, name: str, args: Any) -> dict[str, Any]:
    """This rank's numbers of one phase."""
    from longboat.core.device import get_accelerator

    acc = get_accelerator()
    if name.startswith("dp"):
        ov = lt.overrides(args.shape, world)
        r = train_timed("llm", lt.EXPERIMENT, ov, acc, warmup=args.warmup, steps=args.steps)
        return lt.entry(name, r, args.flops)
    c = args.tp_shape
    ov = [*lt.shape_overrides(c), *la.data_overrides(c, args.data_dir),
          f"model.init_from={args.hf_dir}", f"parallel.tensor_parallel={world}"]  # fmt: skip
    r = train_timed("llm", lt.EXPERIMENT, ov, acc, warmup=1, steps=args.tp_steps - 2)
    return lt.entry(name, r, args.tp_flops)


def summarize(name: str, world: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = per_rank[0]
    mem = [r["peak_mem_gb"] for r in per_rank]
    # Every rank's step ends with the same collectives: rank 0's step time is the step's.
    return {**{k: v for k, v in r0.items() if k not in ("rank", "mfu")},
            "gpus": world, "tokens_per_s_per_gpu": r0["tokens_per_s"] / world,
            "mfu_per_gpu": r0["mfu"] / world, "peak_mem_gb_per_gpu": mem, "peak_mem_gb": max(mem),
            "median_step_s_per_rank": [r["median_step_s"] for r in per_rank]}  # fmt: skip


def band_curves(path: Path, c: dict[str, Any], seed: int) -> dict[str, Any]:
    """The noise band of an ``llm_loss_alignment`` result (its ``reference`` and
    ``reference_perturbed`` curves), or why it does not apply to the TP phases' shape ``c``."""
    band = json.loads(path.read_text())
    cfg, curves = band.get("config", {}), {r["name"]: r["losses"] for r in band.get("runs", [])}
    default = {"family": "llama3", "tie": 0}
    off = [f"{k}={cfg.get(k, default.get(k))} (TP phases: {c.get(k, default.get(k))})"
           for k in BAND_KEYS if cfg.get(k, default.get(k)) != c.get(k, default.get(k))]  # fmt: skip
    if cfg.get("seed") != seed:
        off.append(f"seed={cfg.get('seed')} (TP phases: {seed})")
    if not {"reference", "reference_perturbed"} <= set(curves):
        off.append("no reference / reference_perturbed curves")
    out: dict[str, Any] = {
        "source": str(path),
        "commit": band.get("commit"),
        "date": band.get("date"),
    }
    if off:
        return {**out, "error": "the band's run differs: " + "; ".join(off)}
    return {**out, "reference": curves["reference"], "reference_perturbed": curves["reference_perturbed"]}  # fmt: skip


def finish(result: dict[str, Any]) -> None:
    runs = {r["name"]: r for r in result["runs"] if "losses" in r}
    if "dp1" in runs and "dp2" in runs:
        ratio = runs["dp2"]["tokens_per_s"] / runs["dp1"]["tokens_per_s"]
        runs["dp2"]["scaling_vs_dp1"] = result["dp_scaling"] = ratio
        result["dp_scaling_meets_target"] = ratio >= DP_SCALING_TARGET
    a, b = (runs[n]["losses"] if n in runs else None for n in ("tp1", "tp2"))
    if not (a and b and len(a) == len(b)):
        return
    diffs = [abs(x - y) for x, y in zip(a, b)]
    result["tp"].update(steps=len(a), max_abs_loss_diff=max(diffs),
                        mean_abs_loss_diff=sum(diffs) / len(diffs),
                        first_step_rel_diff=abs(a[0] - b[0]) / abs(a[0]))  # fmt: skip
    result["max_abs_loss_diff"] = max(diffs)
    if "tokens_per_s" in runs["tp1"] and "tokens_per_s" in runs["tp2"]:
        ratio = runs["tp2"]["tokens_per_s"] / runs["tp1"]["tokens_per_s"]
        runs["tp2"]["speedup_vs_tp1"] = result["tp"]["tp2_vs_tp1_tokens_per_s"] = ratio
    band = result["tp"].get("band")
    if band and "error" not in band:
        ref, pert = band["reference"], band["reference_perturbed"]
        if len(ref) < len(a):
            band["error"] = f"the band has {len(ref)} steps, the TP curves {len(a)}"
            return
        signed = bench_align.differences(pert[: len(a)], ref[: len(a)], relative=False)
        d = bench_align.differences(b, a, relative=False)
        result["tp"]["verdict"] = bench_align.judge_differences(d, signed, relative=False)


def table(result: dict[str, Any]) -> str:
    header = ["run", "GPUs", "tokens/s total", "tokens/s per GPU", "vs 1 GPU", "MFU per GPU",
              "peak mem per GPU (GB)", "median step (s)"]  # fmt: skip
    rows = []
    for r in result["runs"]:
        if "tokens_per_s" not in r:
            rows.append(failed_row(r, len(header)))
            continue
        ratio = r.get("scaling_vs_dp1", r.get("speedup_vs_tp1"))
        rows.append([r["name"], str(r["gpus"]), fmt(r["tokens_per_s"], ".1f", 1e-3, "k"),
                     fmt(r["tokens_per_s_per_gpu"], ".1f", 1e-3, "k"), fmt(ratio, ".3f", suffix="x"),
                     fmt(r["mfu_per_gpu"], ".1%"),
                     ", ".join(f"{m:.1f}" for m in r["peak_mem_gb_per_gpu"]),
                     fmt(r["median_step_s"], ".4f")])  # fmt: skip
    lines = [md_table(header, rows)]
    tp, curves = result["tp"], {r["name"]: r["losses"] for r in result["runs"] if "losses" in r}
    if "tp" in result["config"]["phases"]:
        tp_row = ["TP=2 vs TP=1", "not run (see errors / skipped)", "", "", "", "", ""]
        if "max_abs_loss_diff" in tp:
            a, b, v = curves["tp1"], curves["tp2"], tp.get("verdict")
            band = "no band given (--tp-band)"
            if v:
                band = (f"band max {v['band_max_diff']:.2e}, mean {v['band_mean_diff']:.2e}: "
                        + ("inside" if v["passes"] else "OUTSIDE"))  # fmt: skip
            elif "error" in tp.get("band", {}):
                band = "band not applied: " + tp["band"]["error"].replace("|", "/")
            tp_row = ["TP=2 vs TP=1", str(len(a)), f"{a[0]:.4f} / {b[0]:.4f}",
                      f"{a[-1]:.4f} / {b[-1]:.4f}", f"{tp['max_abs_loss_diff']:.4f}",
                      f"{tp['mean_abs_loss_diff']:.4f}", band]  # fmt: skip
        lines += ["", md_table(["TP check", "steps", "first loss TP1 / TP2", "last loss TP1 / TP2",
                                "max abs diff", "mean abs diff", "noise band (llm_loss_alignment)"],
                               [tp_row])]  # fmt: skip
    lines += [f"- {line}" for line in result["skipped"] + result["errors"]]
    if "tp2_vs_tp1_tokens_per_s" in tp:
        lines.append(
            f"\nTP=2 / TP=1 tokens/s ({tp['shape']}): {tp['tp2_vs_tp1_tokens_per_s']:.3f}x"
        )
    if "dp_scaling" in result:
        lines.append(
            f"\nDP=2 / DP=1 tokens/s: {result['dp_scaling']:.3f}x (target >= {DP_SCALING_TARGET}x)"
        )
    return "\n".join(lines)


def stem(result: dict[str, Any], tiny: bool) -> str:
    """``llm_scaling[_<phases>][_<tp shape>]_<date>[_tiny]``: a run of some phases or another TP
    shape does not overwrite the default run's files."""
    cfg, parts = result["config"], ["llm_scaling"]
    if sorted(cfg["phases"]) != sorted(PHASES):
        parts += cfg["phases"]
    if "tp" in cfg["phases"] and cfg["tp_shape_name"] != "886m":
        parts.append(cfg["tp_shape_name"])
    return "_".join([*parts, result["date"]]) + ("_tiny" if tiny else "")


def write(result: dict[str, Any], args: Any) -> None:
    finish(result)
    runs = [r for r in result["runs"] if "tokens_per_s" in r]
    cfg = result["config"]
    title = (f"llm_scaling {result['date']} {result['gpu']}: DP {cfg['params'] / 1e6:.1f}M params, "
             f"micro-batch {cfg['micro_batch']}/GPU; TP {cfg['tp_shape_name']}")  # fmt: skip
    names = [r["name"] for r in runs]
    panels = [([r["tokens_per_s"] / 1e3 for r in runs], "tokens/s total (thousands)")]
    plot = lambda plt: runs and env.bar_chart(plt, title, names, panels)  # noqa: E731
    md = table(result)
    env.write_results(result, out=args.out, results_dir=args.results_dir,
                      stem=stem(result, args.tiny), table=md, plot=plot)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, gloo on CPU (smoke)")
    p.add_argument("--phases", default="dp,tp", help="comma list out of dp, tp")
    p.add_argument("--steps", type=int, default=20, help="timed steps per throughput run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tp-shape", choices=sorted(lt.SHAPES), default="886m", help="TP phases' shape")
    p.add_argument("--tp-steps", type=int, default=50, help="steps of the TP loss curves (>= 3)")
    p.add_argument("--tp-micro-batch", type=int, default=None, help="default: TP_MICRO_BATCH")
    p.add_argument("--tp-band", type=Path, default=None, help="an llm_loss_alignment result")
    p.add_argument("--time-budget", type=float, default=0, help="seconds for everything (0: none)")
    p.add_argument("--seed", type=int, default=0, help="the HF model's init")
    p.add_argument("--data-dir", type=Path, default=la.CACHE, help="the quickstart corpus cache")
    args = p.parse_args(argv)
    t_start = time.time()
    phases = args.phases.split(",")
    if not phases or set(phases) - set(PHASES) or len(set(phases)) != len(phases):
        p.error(f"--phases {args.phases}: a comma list out of {', '.join(PHASES)}")
    if args.tp_steps < 3:
        p.error("--tp-steps: at least 3 (step 1 warms up, the last is not timed)")
    if args.tp_band is not None and not args.tp_band.is_file():
        p.error(f"--tp-band {args.tp_band}: no such file")
    preflight(p, args, "longboat.llm.train.training")
    args.shape = dict(lt.TINY if args.tiny else lt.FULL)
    mb = args.tp_micro_batch or (None if args.tiny else TP_MICRO_BATCH[args.tp_shape])
    args.tp_shape_name, args.tp_shape = args.tp_shape, la.shape(args.tiny, mb, name=args.tp_shape)
    model = compose("llm", lt.EXPERIMENT, lt.overrides(args.shape), "unused").model
    args.flops = ref.flops_per_token(model, args.shape["seq"])
    tp = compose("llm", lt.EXPERIMENT, [*lt.shape_overrides(args.tp_shape),
                 *la.data_overrides(args.tp_shape, args.data_dir)], "unused")  # fmt: skip
    args.tp_flops = ref.flops_per_token(tp.model, args.tp_shape["seq"])
    config = {**args.shape, "flavor": "tiny" if args.tiny else "886m", "experiment": lt.EXPERIMENT,
              "phases": phases, "params": ref.param_count(model),
              "dp_overrides": lt.overrides(args.shape, 2), "steps": args.steps,
              "warmup": args.warmup, "tp_steps": args.tp_steps, "tp_shape_name": args.tp_shape_name,
              "tp_shape": args.tp_shape, "tp_params": ref.param_count(tp.model),
              "tp_flops_per_token": args.tp_flops, "backend": "gloo (cpu)" if args.tiny else "nccl",
              "flops_per_token": args.flops, "peak_flops": env.PEAK_BF16_FLOPS,
              "time_budget_s": args.time_budget}  # fmt: skip
    result = env.result_meta("llm_scaling", not args.tiny, lt.PEERS, config)
    result.update(gpus=2, tp={"data": "quickstart text (llm_loss_alignment)",
                              "shape": args.tp_shape_name},
                  dp_scaling_target=DP_SCALING_TARGET, skipped=[], errors=[])  # fmt: skip
    if args.tp_band is not None:
        result["tp"]["band"] = band_curves(args.tp_band, args.tp_shape, args.seed)
    args.hf_dir = tempfile.mkdtemp(prefix="llm_scaling_hf_")
    try:  # the TP phases' initial weights and corpus, made once (the workers are daemons: no pool)
        if "tp" in phases:
            from longboat.llm.quickstart.prepare import prepare_quickstart

            prepare_quickstart(tp.data)
            torch.manual_seed(args.seed)
            ref.hf_causal_lm(tp.model, torch.device("cpu")).save_pretrained(args.hf_dir)
        todo = [phase for name in phases for phase in PHASES[name]]
        run_phases(todo, run_phase, (args,), summarize, result, lambda: write(result, args),
                   cpu=args.tiny, time_budget=args.time_budget, t_start=t_start,
                   phase_s=15.0 if args.tiny else 40.0)  # fmt: skip
    finally:
        shutil.rmtree(args.hf_dir, ignore_errors=True)
    print(table(result), flush=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
