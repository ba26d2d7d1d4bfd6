"""MoE expert parallelism on one host: the 4-layer Qwen3-30B-A3B shape at EP=2 vs one GPU.

    python tools/bench/moe_scaling.py --results-dir DIR [--out results.json] [--tiny]
        [--phases ep1,ep2,ep1_gbs1] [--steps 20] [--warmup 5] [--time-budget S]
        [--override KEY=VALUE ...]

Shape (``qwen3_moe_4l``): Qwen3-30B-A3B cut to 4 layers (128 experts, top-8, expert SwiGLU
768, hidden 2048, 32 heads / 4 KV, head_dim 128, untied vocab 151,936, qk-norm, the released
load-balancing loss weight 0.001), seq 4096, micro-batch 1. Both phases are
``longboat-llm train`` (``build_training`` + ``Trainer``, the CLI's defaults plus the shape,
``data=synthetic`` and the keys below) in their own processes (``bench_procs``: one per GPU,
NCCL; gloo on CPU with ``--tiny``), from one seeded HF ``Qwen3MoeForCausalLM`` the parent saves
in bf16 (``llm.init_from_hf``), on the same random-token rows (``--override``: more keys for
every phase):

- ``ep1``: one process, a global batch of 2 rows (two microbatches of one step: the CLI's
  eager step, since a CUDA graph captures one microbatch).
- ``ep2``: two processes with ``parallel.expert_parallel=2``: 64 experts per rank, the dense
  part data-parallel, each rank one row of the same global batch of 2 (``GlobalBatchSchedule``:
  ep1's microbatch i is ep2's rank i), so both train the same curve.
- ``ep1_gbs1``: one process, one row a step (one GPU as a user runs it by default: one
  microbatch, the CUDA-graph step where it applies).

Per phase: tokens/s (the global batch's tokens over rank 0's median device step), MFU per GPU on
the active parameters (6 N_active + 6 L s d_attn per token), every rank's peak memory, the loss
curve. The target: ep2's tokens/s >= 1.7 x the faster one-GPU run's. Router statistics of step 0
of ep1 and ep2, read by forward hooks
on megatron's routers (the stack exposes none): per MoE layer and row, the tokens each expert
receives (``routing_map`` summed) and the load-balancing loss megatron's MoE metrics tracker
records for that router call (``load_balancing_loss``, before its coefficient); ep2's must equal
ep1's (the fraction of token-to-expert assignments that differ, the loss's relative difference;
layer 1 sees identical inputs, later layers the experts' outputs, whose bf16 rounding depends on
how many tokens an expert's GEMM takes). Writes ``<results-dir>/moe_scaling_<date>[_tiny]
.{json,md,png}`` (and ``--out``) after every phase.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH / "baselines")]

import bench_env as env  # noqa: E402
import llm_reference as ref  # noqa: E402
import llm_throughput as lt  # noqa: E402
from bench_env import failed_row, fmt, md_table  # noqa: E402
from bench_procs import preflight, run_phases  # noqa: E402
from bench_train import compose, train_timed  # noqa: E402

SHAPE = "qwen3_moe_4l"
FULL = lt.QWEN3_MOE_4L
TINY = lt.QWEN3_MOE_TINY
PHASES = {"ep1": (1, 2), "ep2": (2, 2), "ep1_gbs1": (1, 1)}
"""Each phase's processes and rows a step (micro-batch 1)."""
EP_SCALING_TARGET = 1.7
ROUTER_TOL = 1e-3
"""Router statistics count as equal when at most this fraction of the token-to-expert
assignments differ and the load-balancing losses are this close (relative)."""


def overrides(c: dict[str, Any], world: int, rows: int, hf_dir: str | None) -> list[str]:
    """The shape (with its expert keys), a global batch of ``rows`` rows, random tokens, EP
    over ``world``."""
    out = [*lt.overrides(c, rows // c["micro_batch"]), f"parallel.expert_parallel={world}"]
    return out + ([f"llm.init_from_hf={hf_dir}"] if hf_dir else [])


class RouterStats:
    """Forward hooks on every megatron router of a built run: for each layer, the first
    ``calls`` training forwards' tokens per expert and the load-balancing loss the MoE metrics
    tracker recorded in that call or, with transformers' pooled term on (``model.moe_aux_loss``
    auto / hf: megatron records none), ``E * sum_e f_e P_e`` of the layer from the router's
    record (device tensors until ``read``; no host sync in between)."""

    def __init__(self, calls: int) -> None:
        self.calls = calls
        self.counts: dict[int, list[torch.Tensor]] = {}
        self.aux: dict[int, list[torch.Tensor]] = {}
        self._before: dict[int, torch.Tensor | None] = {}
        self._handles: list[Any] = []

    def attach(self, training: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        if training.cfg.train.activation_checkpointing != "none":
            raise ValueError("router statistics need train.activation_checkpointing=none")
        routers = [m for chunk in training.step_fn.chunks for m in chunk.modules()
                   if isinstance(m, TopKRouter)]  # fmt: skip
        if not routers:
            raise RuntimeError("the built model has no megatron TopKRouter")
        for router in routers:
            self._handles.append(router.register_forward_pre_hook(self._pre))
            self._handles.append(router.register_forward_hook(self._post))

    def _wanted(self, router: Any) -> bool:
        n = len(self.counts.get(router.layer_number, []))
        return router.training and torch.is_grad_enabled() and n < self.calls

    def _pre(self, router: Any, inputs: Any) -> None:
        if self._wanted(router):
            entry = _tracker().metrics.get("load_balancing_loss")
            before = None if entry is None else entry.values[router.layer_number - 1].clone()
            self._before[router.layer_number] = before

    def _post(self, router: Any, inputs: Any, output: Any) -> None:
        if not self._wanted(router):
            return
        layer, routing_map = router.layer_number, output[1]
        self.counts.setdefault(layer, []).append(routing_map.sum(0))
        entry = _tracker().metrics.get("load_balancing_loss")
        stats = getattr(router, "aux_stats", None)
        if entry is not None:
            before = self._before.get(layer)
            after = entry.values[layer - 1]
            self.aux.setdefault(layer, []).append(after - before if before is not None else after.clone())  # fmt: skip
        elif stats is not None:  # the pooled (transformers') term: this layer's share of it
            from longboat.llm.pooled_aux_router import balance_loss

            counts, prob_sums, rows = stats
            self.aux.setdefault(layer, []).append(balance_loss(counts, prob_sums.detach(), rows))

    def read(self, training: Any) -> dict[str, Any]:
        """``{"router": {layer: {"tokens_per_expert": [per call], "load_balancing_loss": [per
        call]}}}`` (layers as strings: the result is JSON)."""
        for handle in self._handles:
            handle.remove()
        out = {}
        for layer in sorted(self.counts):
            aux = self.aux.get(layer, [])
            out[str(layer)] = {"tokens_per_expert": [c.tolist() for c in self.counts[layer]],
                               "load_balancing_loss": [float(a) for a in aux]}  # fmt: skip
        return {"router": out}


def _tracker() -> Any:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker()


def run_phase(rank: int, world: int, name: str, args: Any) -> dict[str, Any]:
    """This rank's numbers of one phase."""
    from longboat.core.device import get_accelerator

    rows = PHASES[name][1]
    stats = RouterStats(calls=rows // world)
    ov = [*overrides(args.shape, world, rows, args.hf_dir), *args.override]
    r = train_timed("llm", lt.EXPERIMENT, ov, get_accelerator(), warmup=args.warmup,
                    steps=args.steps, prepare=stats.attach, probe=stats.read)  # fmt: skip
    return lt.entry(name, r, args.flops)


def summarize(name: str, world: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One run: rank 0's step, every rank's memory; the router statistics per layer as one
    list of rows of the global batch (ep1: its microbatches; ep2: rank 0's row, then rank 1's)."""
    r0, mem = per_rank[0], [r["peak_mem_gb"] for r in per_rank]
    router = {
        layer: {key: [row for r in per_rank for row in r["router"][layer][key]]
                for key in ("tokens_per_expert", "load_balancing_loss")}
        for layer in r0["router"]
    }  # fmt: skip
    return {**{k: v for k, v in r0.items() if k not in ("rank", "mfu", "router")}, "gpus": world,
            "tokens_per_s_per_gpu": r0["tokens_per_s"] / world, "mfu_per_gpu": r0["mfu"] / world,
            "peak_mem_gb_per_gpu": mem, "peak_mem_gb": max(mem),
            "median_step_s_per_rank": [r["median_step_s"] for r in per_rank], "router": router}  # fmt: skip


def compare_router(one: dict[str, Any], two: dict[str, Any], topk: int) -> dict[str, Any]:
    """Per layer: the fraction of token-to-expert assignments that differ (half the summed
    |count difference| over every row's tokens x top-k) and the largest relative difference
    of a row's load-balancing loss; ``equal`` when both are within ``ROUTER_TOL``."""
    layers: dict[str, Any] = {}
    for layer, a in one.items():
        b = two.get(layer)
        rows_a, rows_b = a["tokens_per_expert"], b["tokens_per_expert"] if b else []
        if len(rows_a) != len(rows_b) or not rows_a:
            layers[layer] = {"error": f"{len(rows_a)} rows in ep1, {len(rows_b)} in ep2"}
            continue
        moved = sum(abs(x - y) for ra, rb in zip(rows_a, rows_b) for x, y in zip(ra, rb)) / 2
        assignments = sum(sum(r) for r in rows_a)
        la, lb = a["load_balancing_loss"], b["load_balancing_loss"]
        rel = [abs(x - y) / abs(x) if x else abs(y) for x, y in zip(la, lb)]
        layers[layer] = {
            "tokens_per_row": assignments // len(rows_a) // topk,
            "assignments_differing": moved / assignments,
            "counts_identical": rows_a == rows_b,
            "load_balancing_loss_max_rel_diff": max(rel) if rel and len(la) == len(lb) else None,
        }
    ok = all("error" not in v and v["assignments_differing"] <= ROUTER_TOL
             and v["load_balancing_loss_max_rel_diff"] is not None
             and v["load_balancing_loss_max_rel_diff"] <= ROUTER_TOL for v in layers.values())  # fmt: skip
    return {"layers": layers, "equal": bool(layers) and ok, "tolerance": ROUTER_TOL}


def finish(result: dict[str, Any]) -> None:
    runs = {r["name"]: r for r in result["runs"] if "tokens_per_s" in r}
    two, singles = runs.get("ep2"), [runs[n] for n in ("ep1", "ep1_gbs1") if n in runs]
    if two is None or not singles:
        return
    for one in singles:
        two[f"scaling_vs_{one['name']}"] = two["tokens_per_s"] / one["tokens_per_s"]
    best = max(singles, key=lambda r: r["tokens_per_s"])
    result["ep_scaling"] = two["tokens_per_s"] / best["tokens_per_s"]
    result["ep_scaling_vs"] = best["name"]
    result["ep_scaling_meets_target"] = result["ep_scaling"] >= EP_SCALING_TARGET
    if "ep1" not in runs:
        return
    one = runs["ep1"]
    result["router_check"] = compare_router(one["router"], two["router"], result["config"]["topk"])
    diffs = [abs(x - y) for x, y in zip(one["losses"], two["losses"])]
    result["max_abs_loss_diff"] = max(diffs)
    result["mean_abs_loss_diff"] = sum(diffs) / len(diffs)


def table(result: dict[str, Any]) -> str:
    header = ["run", "GPUs", "rows a step", "tokens/s total", "tokens/s per GPU", "ep2 vs it",
              "MFU per GPU (active params)", "peak mem per GPU (GB)", "median step (s)",
              "first / last loss"]  # fmt: skip
    rows = []
    for r in result["runs"]:
        if "tokens_per_s" not in r:
            rows.append(failed_row(r, len(header)))
            continue
        ep2 = next((x for x in result["runs"] if x["name"] == "ep2"), {})
        rows.append([r["name"], str(r["gpus"]), str(PHASES[r["name"]][1]),
                     fmt(r["tokens_per_s"], ".1f", 1e-3, "k"),
                     fmt(r["tokens_per_s_per_gpu"], ".1f", 1e-3, "k"),
                     fmt(ep2.get(f"scaling_vs_{r['name']}"), ".3f", suffix="x"),
                     fmt(r["mfu_per_gpu"], ".1%"),
                     ", ".join(f"{m:.1f}" for m in r["peak_mem_gb_per_gpu"]),
                     fmt(r["median_step_s"], ".4f"),
                     f"{r['losses'][0]:.4f} / {r['losses'][-1]:.4f}"])  # fmt: skip
    lines = [md_table(header, rows)]
    check = result.get("router_check")
    if check:
        router_rows = [
            [layer, str(v.get("tokens_per_row", "-")), fmt(v.get("assignments_differing"), ".2e"),
             str(v.get("counts_identical", "-")), fmt(v.get("load_balancing_loss_max_rel_diff"), ".2e")]
            if "error" not in v else [layer, v["error"], "", "", ""]
            for layer, v in check["layers"].items()
        ]  # fmt: skip
        lines += ["", md_table(["MoE layer (step 0)", "tokens per row", "assignments differing",
                                "counts identical", "load-balancing loss max rel diff"],
                               router_rows)]  # fmt: skip
    lines += [f"- {line}" for line in result["skipped"] + result["errors"]]
    if check:
        lines.append(
            f"\nloss curves: max |ep2 - ep1| {result['max_abs_loss_diff']:.2e}, mean "
            f"{result['mean_abs_loss_diff']:.2e}; router statistics "
            f"{'equal' if check['equal'] else 'NOT equal'} (tolerance {ROUTER_TOL:g})"
        )  # fmt: skip
    if "ep_scaling" in result:
        lines.append(f"\nEP=2 / one GPU ({result['ep_scaling_vs']}) tokens/s: "
                     f"{result['ep_scaling']:.3f}x (target >= {EP_SCALING_TARGET}x)")  # fmt: skip
    return "\n".join(lines)


def write(result: dict[str, Any], args: Any) -> None:
    finish(result)
    runs = [r for r in result["runs"] if "tokens_per_s" in r]
    title = f"moe_scaling {result['date']} {result['gpu']}: {SHAPE}, seq {args.shape['seq']}"
    names = [r["name"] for r in runs]
    panels = [([r["tokens_per_s"] / 1e3 for r in runs], "tokens/s total (thousands)"),
              ([r["peak_mem_gb"] for r in runs], "peak memory per GPU (GB)")]  # fmt: skip
    plot = lambda plt: runs and env.bar_chart(plt, title, names, panels)  # noqa: E731
    stem = f"moe_scaling_{result['date']}{'_tiny' if args.tiny else ''}"
    env.write_results(result, out=args.out, results_dir=args.results_dir, stem=stem,
                      table=table(result), plot=plot)  # fmt: skip


def save_hf_model(model_cfg: Any, out: str, seed: int) -> None:
    """A seeded ``Qwen3MoeForCausalLM`` of ``model_cfg`` (the family's own HF config), saved in
    bf16 (what both phases load)."""
    from transformers import Qwen3MoeForCausalLM

    from longboat.llm.models.registry import get_family

    hf_cfg = get_family(model_cfg.name).to_hf_config(model_cfg)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf_cfg)
    model.to(torch.bfloat16).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, gloo on CPU (smoke)")
    p.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma list out of {', '.join(PHASES)}"
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--time-budget", type=float, default=0, help="seconds for everything (0: none)")
    p.add_argument("--seed", type=int, default=0, help="the HF model's init")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="another config key for every phase (e.g. train.cuda_graph=false)")  # fmt: skip
    args = p.parse_args(argv)
    t_start = time.time()
    phases = args.phases.split(",")
    if not phases or set(phases) - set(PHASES) or len(set(phases)) != len(phases):
        p.error(f"--phases {args.phases}: a comma list out of {', '.join(PHASES)}")
    args.override = [f"{k}={v}" for k, v in env.key_values(args.override, "--override").items()]
    preflight(p, args, "longboat.llm.train.training")
    args.shape = dict(TINY if args.tiny else FULL)
    model = compose("llm", lt.EXPERIMENT, overrides(args.shape, 1, 1, None), "unused").model
    args.flops = ref.flops_per_token(model, args.shape["seq"])
    total, active = ref.param_counts(model)
    config = {**args.shape, "shape": SHAPE, "flavor": "tiny" if args.tiny else SHAPE,
              "experiment": lt.EXPERIMENT, "phases": {n: PHASES[n] for n in phases},
              "overrides": {n: [*overrides(args.shape, *PHASES[n], "<hf dir>"), *args.override]
                            for n in phases},
              "params": total, "active_params": active, "steps": args.steps,
              "warmup": args.warmup, "seed": args.seed, "flops_per_token": args.flops,
              "peak_flops": env.PEAK_BF16_FLOPS, "backend": "gloo (cpu)" if args.tiny else "nccl",
              "time_budget_s": args.time_budget}  # fmt: skip
    result = env.result_meta("moe_scaling", not args.tiny, lt.PEERS, config)
    result.update(gpus=2, ep_scaling_target=EP_SCALING_TARGET, skipped=[], errors=[])
    args.hf_dir = tempfile.mkdtemp(prefix="moe_scaling_hf_")
    try:  # the workers are daemons: the weights are made here, once
        save_hf_model(model, args.hf_dir, args.seed)
        run_phases([(n, PHASES[n][0]) for n in phases], run_phase, (args,), summarize, result, lambda: write(result, args),
                   cpu=args.tiny, time_budget=args.time_budget, t_start=t_start,
                   phase_s=15.0 if args.tiny else 60.0)  # fmt: skip
    finally:
        shutil.rmtree(args.hf_dir, ignore_errors=True)
    print(table(result), flush=True)
    ok = not result["errors"] and result.get("router_check", {}).get("equal", "ep1" not in phases)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
