"""LLM training throughput: HF transformers vs megatron-core vs longboat, one process.

    python tools/bench/llm_throughput.py --out results.json [--tiny] [--steps N] [--warmup N]
        [--runs hf_eager,hf_compiled,mcore_local_spec,longboat,...] [--results-dir DIR]
        [--time-budget S] [--profile-steps N --profile-dir DIR]

Model (benchmarks/notes/llm.md): Llama-style, 886M parameters (hidden 2048, 16 layers, 16 heads / 8 KV,
head_dim 128, SwiGLU 5632, vocab 32000, untied head), seq 2048, micro-batch 8 (``--tiny``: a
CPU-sized shape), one device, random init, random tokens. ``--shape qwen3_1_7b``: Qwen3-1.7B;
``--shape qwen3_moe_4l``: Qwen3-30B-A3B cut to 4 layers (128 experts, top-8, expert SwiGLU
768, hidden 2048, 32 heads / 4 KV, qk-norm, untied vocab 151,936, load-balancing loss weight
0.001), seq 4096, micro-batch 1, against transformers' ``Qwen3MoeForCausalLM`` (its
``grouped_mm`` experts; the load-balancing loss in both losses; MFU on the active parameters;
``hf_liger`` skipped, ``longboat_sequential_experts``: megatron's per-expert loop)::

    python3 tools/bench/llm_throughput.py --shape qwen3_moe_4l \\
        --runs hf_eager,longboat,longboat_no_graph,longboat_sequential_experts --steps 10 --warmup 3

(the default run first: a longboat MoE run leaves memory allocated in the process, which
later runs' peaks include.)

Runs, in turn:

- ``longboat``: ``longboat-llm train experiment=quickstart`` with only the benchmark's shape
  (``model=llama3_tiny`` + ``model.*``), batch, step count and ``data=synthetic``
  (``overrides``): the stack's ``build_training`` run by core's ``Trainer``, the CLI's defaults
  for every lever (bf16, AdamW clipped at 1.0, fused linear CE, wgrad fusion, the NaN guard, ...).
  ``longboat_<variant>``: the same plus the config keys of ``VARIANTS``.
- ``hf_eager`` / ``hf_compiled`` / ``hf_liger`` and ``mcore_local_spec``: the baselines' own code
  (``baselines/llm_reference.py``, which lists how each differs from upstream) with the longboat
  config's shapes and optimizer settings. ``hf_liger`` runs when ``liger-kernel`` is installed,
  after the others (Liger patches transformers' classes process-wide).
- ``titan_compiled`` / ``titan_float8``: torchtitan's Llama 3 model, compiled per block, and its
  one-device training step (fp32 params under bf16 autocast, fused AdamW); ``titan_float8`` adds
  its Float8 converter (torchao, tensorwise scaling, the LM head in bf16)
  (``baselines/titan_reference.py`` lists how they differ from torchtitan's ``train.py``). They
  run the Llama shape where torchtitan (0.2.x) is installed; asked for without it, each is a
  skipped row saying so.

Per run: median step time over ``--steps`` timed steps after ``--warmup`` (``bench_timing``:
steps back to back, device events between them), tokens/s, the window's wall-clock tokens/s,
MFU = tokens/s x FLOPs/token / 989 TFLOP/s (``llm_reference.flops_per_token``: 6 N + 6 L s
d_attn, N the parameters a token passes through: the top-k experts of an MoE model), peak
device memory (reset before the build: weights, grads and optimizer state count).
A failed run (or one over its share of ``--time-budget``) records its error; the others still
run. Writes ``--out`` and ``<results-dir>/llm_throughput_<date>.{json,md,png}``; prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench_env as env
import torch
from baselines import llm_reference as ref
from baselines import titan_reference as titan
from bench_env import failed_row, fmt, md_table
from bench_profile import profile_steps
from bench_timing import time_loop
from bench_train import compose, train_timed

EXPERIMENT = "quickstart"
FULL = dict(
    vocab=32000,
    hidden=2048,
    layers=16,
    heads=16,
    kv_heads=8,
    head_dim=128,
    ffn=5632,
    seq=2048,
    micro_batch=8,
)
TINY = dict(
    vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, seq=64, micro_batch=2
)
QWEN3_1_7B = dict(
    family="qwen3",
    vocab=151936,
    hidden=2048,
    layers=28,
    heads=16,
    kv_heads=8,
    head_dim=128,
    ffn=6144,
    seq=4096,
    micro_batch=2,
    tie=1,
)
"""The real-vocabulary shape: Qwen3-1.7B (qk-norm, tied embeddings), seq 4096, micro-batch 2."""
QWEN3_MOE_4L = dict(family="qwen3_moe", vocab=151936, hidden=2048, layers=4, heads=32, kv_heads=4,
                    head_dim=128, ffn=6144, experts=128, topk=8, moe_ffn=768, aux=0.001, seq=4096,
                    micro_batch=1, tie=0)  # fmt: skip
"""Qwen3-30B-A3B cut to 4 layers (128 experts, top-8, expert SwiGLU 768, qk-norm, untied
vocab 151,936, the released load-balancing loss weight 0.001), seq 4096, micro-batch 1."""
QWEN3_MOE_TINY = dict(family="qwen3_moe", vocab=256, hidden=64, layers=2, heads=4, kv_heads=2,
                      head_dim=16, ffn=128, experts=4, topk=2, moe_ffn=32, aux=0.001, seq=64,
                      micro_batch=1, tie=0)  # fmt: skip
MOONLIGHT_4L = dict(family="deepseek_v3", flavor="moonlight_16b_a3b", vocab=163840, layers=4,
                    experts=64, seq=4096, micro_batch=1)  # fmt: skip
"""Moonlight-16B-A3B (DeepSeek-V3 architecture: MLA with kv rank 512, 2 shared + 64 routed
experts, top-6 sigmoid routing, vocab 163,840) cut to 4 layers (1 dense + 3 MoE), seq 4096,
micro-batch 1, against transformers' ``DeepseekV3ForCausalLM``; every other key is the
flavor's."""
MOONLIGHT_TINY = dict(family="deepseek_v3", flavor="tiny", vocab=256, layers=3, experts=16, seq=64,
                      micro_batch=1, keys=["model.q_lora_rank=null", "model.num_shared_experts=2",
                      "model.moe_router_num_groups=1", "model.moe_router_group_topk=1",
                      "model.moe_routed_scaling_factor=2.446", "model.num_experts=16",
                      "model.moe_topk=4", "model.norm_eps=1e-5", "model.rope_theta=50000.0"])  # fmt: skip
"""The tiny flavor laid out as Moonlight (no q latent, 2 shared experts, one expert group,
Moonlight's routed scaling, norm epsilon and rotary base), 16 experts top-4, 1 dense + 2 MoE."""
V32_32K = dict(family="deepseek_v3", flavor="v32", vocab=129280, layers=1, seq=32768,
               micro_batch=1, keys=["model.first_k_dense=1", "model.mtp_num_layers=0"])  # fmt: skip
"""DeepSeek-V3.2-Exp cut to its first layer (MLA with 128 heads, the lightning indexer's 64
heads and 2,048 keys per query, the dense SwiGLU of 18,432; no MTP layer), seq 32,768,
micro-batch 1;
``longboat_dense_mla`` is the same model with the indexer off (``model.index_topk=null``)."""
V32_TINY = dict(family="deepseek_v3", flavor="v32_tiny", vocab=256, layers=2, seq=64,
                micro_batch=1)  # fmt: skip
SHAPES = {"886m": FULL, "qwen3_1_7b": QWEN3_1_7B, "qwen3_moe_4l": QWEN3_MOE_4L,
          "moonlight_4l": MOONLIGHT_4L, "v32_32k": V32_32K}  # fmt: skip
TINY_SHAPES = {"886m": TINY, "qwen3_1_7b": {**TINY, "family": "qwen3", "tie": 1},
               "qwen3_moe_4l": QWEN3_MOE_TINY, "moonlight_4l": MOONLIGHT_TINY,
               "v32_32k": V32_TINY}  # fmt: skip
VARIANTS: dict[str, list[str]] = {
    "longboat": [],
    "longboat_compiled": ["train.compile=true"],
    "longboat_no_graph": ["train.cuda_graph=false"],
    "longboat_megatron_step": ["train.cuda_graph=false", "optim.one_pass_adamw=false"],
    "longboat_sequential_experts": ["model.moe_experts=sequential"],
    "longboat_fp8": ["train.precision=fp8"],  # the CLI's default recipe
    "longboat_fp8_rowwise": ["train.precision=fp8", "train.fp8.recipe=rowwise"],
    "longboat_fp8_tensorwise": ["train.precision=fp8", "train.fp8.recipe=tensorwise"],
    "longboat_fp8_adaptive": ["train.precision=fp8", "train.fp8.recipe=adaptive"],
    "longboat_dense_mla": ["model.index_topk=null"],  # DeepSeek-V3.2 without its sparse attention
    "longboat_bf16_moments": ["optim.moment_dtype=bf16"],  # changes numerics (README)
}
"""Config keys each longboat run adds to the CLI's defaults."""
# hf_liger after the HF runs (it patches transformers process-wide); the graphed runs (the
# default ``longboat``) last (a failed capture can leave the process's CUDA RNG unusable).
ALL_RUNS = (
    "hf_eager",
    "hf_compiled",
    "mcore_local_spec",
    "longboat_megatron_step",
    "longboat_no_graph",
    "longboat_compiled",
    "hf_liger",
    "titan_compiled",
    "titan_float8",
    "longboat",
)
PEERS = ("transformers", "triton", "megatron-core", "torchtitan", "torchao")
"""The distributions whose versions the result records."""
MOE_SKIPS = {"hf_liger": ref.LIGER_DENSE_ONLY}
"""Runs an MoE shape leaves out (dropped from the default list, a skipped row when asked for)."""
RUN_WEIGHT = {"hf_compiled": 4.0, "longboat_compiled": 2.5, "hf_eager": 1.5, "longboat": 1.5,
              "titan_compiled": 2.5, "titan_float8": 3.0}  # fmt: skip


def shape_overrides(c: dict[str, int], world: int = 1) -> list[str]:
    """The benchmark's model shape and batch (``micro_batch`` per data-parallel rank); a shape
    with a ``flavor`` takes that flavor's keys and sets only its depth (and its ``keys``)."""
    family = c.get("family", "llama3")
    batch = [f"train.micro_batch_size={c['micro_batch']}",
             f"train.global_batch_size={c['micro_batch'] * world}"]  # fmt: skip
    if "flavor" in c:
        depth = [f"model.num_layers={c['layers']}", *c.get("keys", [])]
        return [f"model={family}_{c['flavor']}", *depth, *batch]
    return [
        f"model={family}_tiny", f"model.vocab_size={c['vocab']}", f"model.hidden_size={c['hidden']}",
        f"model.num_layers={c['layers']}", f"model.num_attention_heads={c['heads']}",
        f"model.num_query_groups={c['kv_heads']}", f"model.head_dim={c['head_dim']}",
        f"model.ffn_hidden_size={c['ffn']}", f"model.max_position_embeddings={c['seq']}",
        f"model.tie_embeddings={str(bool(c.get('tie', 0))).lower()}",
        f"train.micro_batch_size={c['micro_batch']}",
        f"train.global_batch_size={c['micro_batch'] * world}",
    ]  # fmt: skip


def overrides(c: dict[str, int], world: int = 1) -> list[str]:
    """Shape, batch and random tokens (``data=synthetic``)."""
    return [*shape_overrides(c, world), *moe_overrides(c), "data=synthetic",
            f"data.seq_len={c['seq']}", f"data.num_documents={64 * c['micro_batch']}"]  # fmt: skip


def moe_overrides(c: dict[str, Any]) -> list[str]:
    """An MoE shape's expert keys (none for a dense shape or a flavor's own)."""
    if "experts" not in c or "flavor" in c:
        return []
    return [f"model.num_experts={c['experts']}", f"model.moe_topk={c['topk']}",
            f"model.moe_ffn_hidden_size={c['moe_ffn']}", "model.moe_norm_topk_prob=true",
            f"model.moe_aux_loss_coeff={c['aux']}"]  # fmt: skip


def titan_skips(runs: list[str], c: dict[str, Any]) -> dict[str, str]:
    """The torchtitan rows asked for that cannot run: not installed, or not a Llama shape."""
    out = {}
    for r in runs:
        if r not in titan.RUNS:
            continue
        why = titan.unavailable(r)
        if why is None and c.get("family", "llama3") != "llama3":
            why = "the torchtitan rows run the Llama shape (886m) only"
        if why is not None:
            out[r] = why
    return out


def run_longboat_variant(
    name: str, c: dict[str, int], acc: Any, args: Any, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """``build_training`` + ``Trainer`` with the variant's keys (``bench_train``), then
    ``extra`` (e.g. the run's ``train.memory_budget``)."""

    def probe(training: Any) -> dict[str, Any]:
        step = training.step_fn
        fusion = step.chunks[0].config.gradient_accumulation_fusion
        levers = {
            "gradient_accumulation_fusion": bool(fusion),
            "cuda_graph": training.graphed is not None and training.graphed.graph.active,
            "fused_linear_ce": bool(step.fused_linear_ce),
            "one_pass_adamw": step.one_pass is not None,
        }
        fp8 = getattr(training, "fp8_recipe", None)
        plan = getattr(training, "memory_plan", None)
        return {
            "levers": levers,
            "precision": f"fp8 ({fp8})" if fp8 else training.precision,
            "memory_plan": plan if isinstance(plan, str) else plan.line(),
            "recompute": training.cfg.train.recompute,
        }

    out = args.profile_dir and args.profile_dir / f"llm_profile_{name}.txt"
    return train_timed(
        "llm",
        EXPERIMENT,
        [*overrides(c), *VARIANTS[name], *extra],
        acc,
        warmup=args.warmup,
        steps=args.steps,
        profile_steps=args.profile_steps,
        profile_out=out,
        probe=probe,
    )


def run_baseline(name: str, cfg: Any, c: dict[str, int], acc: Any, args: Any) -> dict[str, Any]:
    """A baseline's own loop on 4 rotating batches of random tokens."""
    device = acc.device()
    leftover = env.free_memory(acc)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    notes: dict[str, Any] = {}
    with ref.megatron_state(acc) if name == "mcore_local_spec" else contextlib.nullcontext():
        if name == "mcore_local_spec":
            step = run = ref.McoreStep(cfg.model, cfg.optim, device)
        elif name in titan.RUNS:
            step = run = titan.TitanStep(cfg.model, cfg.optim, device, seq=c["seq"],
                                         micro_batch=c["micro_batch"], float8=name == "titan_float8")  # fmt: skip
            notes.update(step.notes())
        elif name in ("hf_eager", "hf_compiled", "hf_liger"):
            model = ref.hf_causal_lm(cfg.model, device)
            step = ref.HFStep(
                model, cfg.optim, device, compiled=name == "hf_compiled", liger=name == "hf_liger"
            )
            notes["forward"] = step.forward_module
            if cfg.model.num_experts:
                notes["experts"] = ref.hf_experts_kernel(model, compiled=name == "hf_compiled")

            def run(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                return step(tokens)  # HF shifts the labels itself
        else:
            raise ValueError(f"unknown run {name!r}; use one of {ALL_RUNS}")
        build_s = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(args.seed)
        seqs = torch.randint(0, c["vocab"], (4, c["micro_batch"], c["seq"] + 1), generator=gen)
        # torchtitan's step takes CPU batches (its dataloader's) and copies them over itself
        on = torch.device("cpu") if name in titan.RUNS else device
        batches = [(s[:, :-1].to(on), s[:, 1:].to(on)) for s in seqs]
        cycle = (batches[i % 4] for i in range(10**9))
        timing, losses = time_loop(acc, cycle, lambda b, i: run(*b), args.warmup, args.steps)
        if isinstance(step, ref.HFStep):
            notes["logits_materialised"] = step.logits_materialised
        out = args.profile_dir and args.profile_dir / f"llm_profile_{name}.txt"
        summary = profile_steps(acc, lambda i: run(*batches[i % 4]), args.profile_steps, out)
        if summary:
            notes["profile"] = summary
        peak = acc.memory_stats().get("peak_allocated_gb", 0.0)
        if isinstance(step, titan.TitanStep):
            step.close()
    return {"timing": timing, "losses": losses, "peak_mem_gb": peak, "build_s": build_s,
            "items_per_step": c["micro_batch"] * c["seq"], "allocated_at_start_gb": leftover,
            "notes": notes}  # fmt: skip


def entry(name: str, r: dict[str, Any], flops: float) -> dict[str, Any]:
    s = r.pop("timing").summary(r["items_per_step"])
    tokens_per_s = s.pop("items_per_s")
    return {
        "name": name,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops / env.PEAK_BF16_FLOPS,
        "peak_mem_gb": r.pop("peak_mem_gb"),
        "window_tokens_per_s": s.pop("window_items_per_s"),
        **s,
        **r,
    }


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    name = baseline_name(runs)
    base = next((r for r in runs if r["name"] == name), None)
    mfu = "MFU (active params)" if result["config"].get("experts") else "MFU"
    header = ["run", "tokens/s", f"vs {name or 'hf'}", mfu, "peak mem (GB)", "median step (s)",
              "window tokens/s", "last loss"]  # fmt: skip
    rows = []
    for r in runs:
        if "tokens_per_s" not in r:
            rows.append(failed_row(r, len(header)))
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        rows.append([r["name"], fmt(r["tokens_per_s"], ".1f", 1e-3, "k"), ratio,
                     fmt(r["mfu"], ".1%"), fmt(r["peak_mem_gb"], ".1f"),
                     fmt(r["median_step_s"]), fmt(r["window_tokens_per_s"], ".1f", 1e-3, "k"),
                     fmt(r["losses"][-1])])  # fmt: skip
    return md_table(header, rows)


def baseline_name(runs: list[dict[str, Any]]) -> str | None:
    """The run the ratios are against: ``hf_compiled``, else ``hf_eager`` (of those that ran)."""
    done = {r["name"] for r in runs if "tokens_per_s" in r}
    return next((n for n in ("hf_compiled", "hf_eager") if n in done), None)


def plot(result: dict[str, Any]) -> Any:
    runs = [r for r in result["runs"] if "tokens_per_s" in r]
    cfg = result["config"]
    title = (f"llm_throughput {result['date']} {result['gpu']}: {cfg['params'] / 1e6:.0f}M "
             f"params, seq {cfg['seq']}, micro-batch {cfg['micro_batch']}")  # fmt: skip
    return lambda plt: runs and env.bar_chart(
        plt, title, [r["name"] for r in runs],
        [([r["tokens_per_s"] / 1e3 for r in runs], "tokens/s (thousands)"),
         ([r["peak_mem_gb"] for r in runs], "peak memory (GB)")],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="886m", help="model shape")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (>= 10 for results)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", default=None, help=f"comma list out of {','.join(ALL_RUNS)}")
    p.add_argument("--results-dir", type=Path, default=None, help="e.g. benchmarks/results")
    p.add_argument("--time-budget", type=float, default=0, help="seconds for all runs (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-steps", type=int, default=0, help="profiled steps after timing")
    p.add_argument("--profile-dir", type=Path, default=None, help="where profile tables go")
    p.add_argument(
        "--memory-budget",
        default=None,
        help="train.memory_budget of the longboat rows: GB, or a baseline's run name (its "
        "measured peak; that run goes first)",
    )
    args = p.parse_args(argv)
    from longboat.core.device import get_accelerator

    acc = get_accelerator()
    on_gpu = acc.device_type != "cpu"
    c = dict(TINY_SHAPES[args.shape] if args.tiny else SHAPES[args.shape])
    default = ALL_RUNS if on_gpu else ("hf_eager", "mcore_local_spec", "longboat")
    if c.get("family", "llama3") != "llama3":  # megatron's local spec baseline is Llama-shaped
        default = tuple(r for r in default if r != "mcore_local_spec")
    if importlib.util.find_spec("liger_kernel") is None:  # a peer not installed is no failure
        default = tuple(r for r in default if r != "hf_liger")
    if c.get("family", "llama3") != "llama3":  # torchtitan's rows run the Llama shape
        default = tuple(r for r in default if r not in titan.RUNS)
    default = tuple(r for r in default if r not in titan.RUNS or not titan.unavailable(r))
    if "experts" in c:
        default = tuple(r for r in default if r not in MOE_SKIPS)
    runs = args.runs.split(",") if args.runs else list(default)
    skipped = {r: MOE_SKIPS[r] for r in runs if "experts" in c and r in MOE_SKIPS}
    skipped.update(titan_skips(runs, c))
    runs = [r for r in runs if r not in skipped]
    budget_from = args.memory_budget if args.memory_budget in runs else None
    if budget_from:  # the reference first: its measured peak is the longboat rows' budget
        runs = [budget_from, *(r for r in runs if r != budget_from)]
    cfg = compose("llm", EXPERIMENT, overrides(c), "unused")  # the baselines' shapes and optim
    flops = ref.flops_per_token(cfg.model, c["seq"])
    config = {
        **c,
        "flavor": f"tiny_{args.shape}" if args.tiny else args.shape,
        "experiment": EXPERIMENT,
        "overrides": overrides(c),
        "variants": VARIANTS,
        "params": ref.param_count(cfg.model),
        "active_params": ref.param_counts(cfg.model)[1],
        "precision": cfg.train.precision,
        "optim": _plain(cfg.optim),
        "steps": args.steps,
        "warmup": args.warmup,
        "flops_per_token": flops,
        "flops_formula": "6*N_active + 6*L*seq*heads*head_dim",
        "peak_flops": env.PEAK_BF16_FLOPS,
        "memory_budget": args.memory_budget,
    }
    result = env.result_meta("llm_throughput", on_gpu, PEERS, config)
    for name, why in skipped.items():  # asked for, but no counterpart for this shape
        why = why.removeprefix("skipped: ")
        print(f"== {name}: skipped ({why})", flush=True)
        result["runs"].append({"name": name, "error": f"skipped: {why}"})

    def budget_keys() -> list[str]:
        if args.memory_budget is None:
            return []
        if budget_from is None:
            return [f"train.memory_budget={float(args.memory_budget)}"]
        ref_row = next(r for r in result["runs"] if r["name"] == budget_from)
        if "peak_mem_gb" not in ref_row:
            raise RuntimeError(f"no memory budget: {budget_from} has no measured peak")
        return [f"train.memory_budget={ref_row['peak_mem_gb']:.2f}"]

    def run_one(name: str) -> dict[str, Any]:
        if name in VARIANTS:
            keys = budget_keys()
            row = entry(name, run_longboat_variant(name, c, acc, args, keys), flops)
            return {**row, "budget_keys": keys} if keys else row
        return entry(name, run_baseline(name, cfg, c, acc, args), flops)

    def write() -> None:
        shape = "" if args.shape == "886m" else f"{args.shape}_"
        fp8 = "fp8_" if any("fp8" in name for name in runs) else ""
        stem = f"llm_throughput_{shape}{fp8}{result['date']}"
        note = f"config: {json.dumps(config)}" + "".join(
            f"\n\n{r['name']}: forward from `{r['notes']['forward']}`, "
            + ("[tokens, vocab] logits materialised" if r["notes"].get("logits_materialised")
               else "no [tokens, vocab] logits (fused linear cross-entropy)")
            + (" (Liger: RoPE, RMSNorm, SwiGLU, fused linear CE)" if r["name"] == "hf_liger" else "")
            + (f"; experts_implementation={r['notes']['experts']}" if "experts" in r["notes"] else "")
            for r in result["runs"]
            if "forward" in r.get("notes", {})
        ) + "".join(
            f"\n\n{r['name']}: torchtitan {r['notes']['versions']['torchtitan']} (torchao "
            f"{r['notes']['versions']['torchao']}), block linears {r['notes']['block_linear']}, "
            f"LM head {r['notes']['lm_head']}, {r['notes']['precision']}; flags `{r['notes']['flags']}`"
            for r in result["runs"]
            if "flags" in r.get("notes", {})
        ) + "".join(
            f"\n\n{r['name']}: {' '.join(r.get('budget_keys', []))} {r['memory_plan']}".replace("  ", " ")
            for r in result["runs"]
            if "memory_plan" in r
        )  # fmt: skip
        env.write_results(result, out=args.out, results_dir=args.results_dir, stem=stem,
                      table=table(result), plot=plot(result), note=note)  # fmt: skip

    env.run_all(runs, run_one, result, write, time_budget=args.time_budget, weights=RUN_WEIGHT,
            describe=lambda r: f"{r['tokens_per_s']:.0f} tokens/s, peak {r['peak_mem_gb']:.1f} GB, "
            f"build {r['build_s']:.1f}s")  # fmt: skip
    write()
    print(table(result))
    return 0


def _plain(section: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(section), default=str))


if __name__ == "__main__":
    raise SystemExit(main())
