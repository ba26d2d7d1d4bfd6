"""LLM training throughput: HF transformers vs megatron-core vs longboat, one process.

    python tools/bench/llm_throughput.py --out results.json [--tiny] [--steps N] [--warmup N]
        [--runs hf_eager,hf_compiled,mcore_local_spec,longboat,longboat_compiled]
        [--results-dir benchmarks/results] [--time-budget S]

Model (BENCHMARKS.md): Llama-style, 886M parameters (hidden 2048, 16 layers, 16 heads / 8 KV
heads, head_dim 128, SwiGLU 5632, vocab 32000, untied head), seq 2048, micro-batch 8, bf16,
AdamW (fused, no grad clipping), random init and random tokens, one device. Runs, in turn,
freeing device memory in between:

- ``hf_eager``: ``transformers.LlamaForCausalLM`` (SDPA attention), fp32 weights + bf16
  autocast (what the HF Trainer does with ``bf16=True``), ``torch.optim.AdamW(fused=True)``.
- ``hf_compiled``: the same, the whole model ``torch.compile``d.
- ``mcore_local_spec``: megatron-core ``GPTModel`` with megatron's local layer spec (no TE),
  bf16 weights, megatron DDP (fp32 grad buffer) + megatron optimizer (fp32 main weights)
  whose inner torch AdamW is switched to ``fused=True``; loss through ``GPTModel``'s labels.
- ``longboat``: the product's training step, ``longboat.llm.train.train_step.build_train_step``
  (what ``longboat-llm train`` runs; nothing patched by this script): megatron ``GPTModel``
  with longboat's layer spec (SDPA flash/cuDNN attention, Triton RMSNorm, SwiGLU and fused
  QKV-split + RoPE), weights initialised on the device, megatron DDP + distributed
  optimizer with torch's fused AdamW, weight-gradient GEMMs accumulating straight into the
  grad buffer, fused linear cross-entropy (no ``[tokens, vocab]`` logits), no host sync in
  the step.
- ``longboat_graphed``: ``longboat`` with the whole step replayed as one CUDA graph
  (``longboat.core.loop.GraphedStep``).
- ``longboat_compiled``: ``longboat`` with each decoder layer ``torch.compile``d.
- ``longboat_fp32grads`` / ``longboat_localopt``: ``longboat`` with an fp32 grad buffer where
  it uses a bf16 one, and that plus megatron's non-distributed optimizer; ``longboat_onepass``
  / ``longboat_graphed_onepass``: the update as one kernel pass per shard
  (``llm.one_pass_adamw``); ``longboat_no_addnorm``: without the fused residual-add +
  RMSNorm. Levers measured against the product's choice (``LONGBOAT_VARIANTS``).
- ``hf_liger`` (when ``liger-kernel`` is installed): ``hf_eager`` with
  ``apply_liger_kernel_to_llama`` (RoPE, RMSNorm, SwiGLU, fused linear CE), the strongest
  peer in BENCHMARKS.md; run last since Liger patches transformers' classes process-wide.

Per run: median step time over ``--steps`` timed steps after ``--warmup``, tokens/s, MFU
and peak device memory (accelerator API; reset before the model is built, so weights, grads
and optimizer state count). Steps run back to back as in a training loop, timed by device
events between steps (``bench_timing.StepClock``; losses are read after the window), so
host work that a real loop hides behind the previous step is not counted; the window's
wall-clock tokens/s is reported too. ``--sync-every-step`` restores the older method
(device synchronize before and after each step).

MFU = tokens/s * FLOPs/token / 989e12, FLOPs/token = 6 * N + 6 * L * s * d_attn
(N = all parameters incl. embedding and head; the attention term is QK^T and AV,
2 * 2 * s * d_attn per token per layer forward, x3 for fwd + bwd, /2 for the causal mask;
d_attn = heads * head_dim). This reproduces BENCHMARKS.md's anchors (70.6k tokens/s = 40.8%).

A run that fails records its error in the JSON; the others still run. Writes
``<results-dir>/llm_throughput_<date>.{json,md,png}`` and ``--out``; prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import importlib.util
import json
import os
import signal
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
for sub in ("packages/core/src", "packages/kernels/src", "packages/llm/src"):
    if str(REPO / sub) not in sys.path:
        sys.path.insert(0, str(REPO / sub))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import git_commit, gpu_name, pyplot, versions  # noqa: E402
from bench_profile import profile_steps  # noqa: E402
from bench_timing import StepClock  # noqa: E402

from longboat.core.device import get_accelerator  # noqa: E402

PEAK_BF16_FLOPS = 989e12
DATE = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
# hf_liger last: liger patches transformers' Llama classes process-wide.
# longboat_graphed last: a failed CUDA-graph capture leaves the process's CUDA RNG unusable
# (hf_liger failed after it on 2026-11-29).
ALL_RUNS = (
    "hf_eager", "hf_compiled", "mcore_local_spec", "longboat", "longboat_fp32grads",
    "longboat_localopt", "longboat_onepass", "longboat_no_addnorm", "longboat_compiled", "hf_liger", "longboat_graphed",
    "longboat_graphed_onepass",
)  # fmt: skip
RUN_WEIGHT = {
    "hf_eager": 1.5, "hf_compiled": 4.0, "longboat": 1.5, "longboat_compiled": 2.5,
    "longboat_graphed": 1.5, "hf_liger": 1.5, "longboat_fp32grads": 1.0, "longboat_localopt": 1.0,
    "longboat_onepass": 1.0, "longboat_graphed_onepass": 1.0, "longboat_no_addnorm": 1.0,
}  # fmt: skip

FULL = dict(
    vocab=32000, hidden=2048, layers=16, heads=16, kv_heads=8, head_dim=128, ffn=5632,
    seq=2048, micro_batch=8,
)  # fmt: skip
TINY = dict(
    vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128,
    seq=64, micro_batch=2,
)  # fmt: skip
LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1


class RunTimeout(Exception):
    """A run outlived its time budget."""


# ----------------------------------------------------------------------------- accounting


def param_count(c: dict[str, int]) -> int:
    """Parameters of the Llama model (untied head), identical for every implementation."""
    h, hd = c["hidden"], c["head_dim"]
    attn = h * c["heads"] * hd + 2 * h * c["kv_heads"] * hd + c["heads"] * hd * h
    layer = attn + 3 * h * c["ffn"] + 2 * h
    return 2 * c["vocab"] * h + c["layers"] * layer + h


def flops_per_token(c: dict[str, int]) -> float:
    """6 N + 6 L s d_attn (see the module docstring)."""
    return 6.0 * param_count(c) + 6.0 * c["layers"] * c["seq"] * c["heads"] * c["head_dim"]


# ----------------------------------------------------------------------------- HF runs


def hf_model(c: dict[str, int], device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        intermediate_size=c["ffn"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        head_dim=c["head_dim"],
        max_position_embeddings=c["seq"],
        tie_word_embeddings=False,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    with device:
        model = LlamaForCausalLM(cfg)
    return model.train()


def adamw(params: Any, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=device.type == "cuda"
    )


def hf_setup(
    c: dict[str, int], device: torch.device, *, compiled: bool, liger: bool = False
) -> Callable[..., Any]:
    model = hf_model(c, device)
    if liger:
        # Liger's RoPE, RMSNorm, SwiGLU and fused linear CE (what HF users add for speed).
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    opt = adamw(model.parameters(), device)
    fwd = torch.compile(model) if compiled else model

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            # HF shifts labels itself: hand it the unshifted sequence.
            loss = fwd(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step.keep = (model, opt, fwd)  # type: ignore[attr-defined]
    return step


# ----------------------------------------------------------------------------- megatron runs


def init_megatron(acc: Any) -> None:
    """A one-rank process group and megatron's parallel state (TP = PP = DP = 1)."""
    import torch.distributed as dist

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.megatron import parallel_state

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        if acc.device_type == "cuda":
            acc.set_device(0)
        dist.init_process_group(
            backend=acc.dist_backend if acc.device_type == "cuda" else "gloo",
            rank=0,
            world_size=1,
        )
        _OWN_PG.append(True)
    # The same RNG state for every run of the process: megatron's tracker is re-seeded each
    # time (initialize seeds it only once) and the caller's CPU seed survives the seeding.
    cpu_state = torch.random.get_rng_state()
    if parallel_state.current_layout() is None:
        parallel_state.initialize(ParallelConfig(), acc, seed=1234)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    torch.random.set_rng_state(cpu_state)


def teardown_megatron() -> None:
    """Undo ``init_megatron`` (parallel state and the process group this script made)."""
    if not _OWN_PG:
        return
    import torch.distributed as dist

    from longboat.core.megatron import parallel_state

    if parallel_state.current_layout() is not None:
        parallel_state.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    _OWN_PG.clear()


def llm_config(c: dict[str, int], backend: str) -> Any:
    from longboat.llm.config import LLMModelConfig

    return LLMModelConfig(
        name="llama3",
        flavor="bench",
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        num_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_query_groups=c["kv_heads"],
        head_dim=c["head_dim"],
        ffn_hidden_size=c["ffn"],
        max_position_embeddings=c["seq"],
        rope_theta=10000.0,
        norm_eps=1e-5,
        layer_backend=backend,
    )


def megatron_optimizer(
    chunks: list[torch.nn.Module], device: torch.device, lr: float = LR, clip: float = 0.0
) -> tuple[Any, Any]:
    """megatron DDP (fp32 grad buffer) + megatron optimizer with a fused inner AdamW."""
    from longboat.core.config.schema import OptimConfig
    from longboat.core.megatron.optimizer import build_optimizer, wrap_ddp

    ddp = wrap_ddp(chunks)
    optim = OptimConfig(
        name="adamw", lr=lr, weight_decay=WD, betas=list(BETAS), eps=EPS, grad_clip=clip
    )
    opt = build_optimizer(ddp, optim, precision="bf16")
    if device.type == "cuda":
        # Without TE / apex megatron falls back to torch's AdamW (foreach); ask for fused.
        for inner in getattr(opt, "chained_optimizers", None) or [opt]:
            for group in inner.optimizer.param_groups:
                group["fused"], group["foreach"] = True, False
    return ddp, opt


_OWN_PG: list[bool] = []  # non-empty when init_megatron created the process group


def pick_attention_backend(c: dict[str, int], acc: Any) -> str:
    """Time ``longboat.kernels.attention`` fwd + bwd at the run's shapes per SDPA backend and
    pin the fastest through ``LONGBOAT_ATTENTION_BACKEND`` (auto picks flash with GQA; cuDNN
    needs K/V expanded but can be faster on Hopper). Outputs must agree with auto's."""
    from longboat.kernels.attention import ENV_VAR, attention

    os.environ.pop(ENV_VAR, None)
    dev = acc.device()
    if dev.type != "cuda":
        return "sdpa (auto; not timed on CPU)"
    b, s, hd = c["micro_batch"], c["seq"], c["head_dim"]
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, s, c["heads"], hd, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, c["kv_heads"], hd, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    timings: dict[str, float] = {}
    ref = None
    for name in ("sdpa", "sdpa_cudnn", "sdpa_flash"):
        try:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            times = []
            for i in range(6):
                acc.synchronize()
                t0 = time.perf_counter()
                out = attention(qq, kk, vv, causal=True, scale=hd**-0.5, backend=name)
                out.backward(dout)
                acc.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            if ref is None:
                ref = out.detach().float()
            elif float((out.detach().float() - ref).abs().max()) > 0.05:
                continue  # disagrees with auto: not used
            timings[name] = statistics.median(times)
        except Exception:
            continue
    best = min(timings, key=timings.__getitem__)
    if best != "sdpa":
        os.environ[ENV_VAR] = best
    return f"{best} ({', '.join(f'{n} {t * 1e3:.2f} ms' for n, t in timings.items())})"


def product_optim(lr: float = LR, clip: float = 0.0) -> Any:
    from longboat.core.config.schema import OptimConfig

    return OptimConfig(
        name="adamw", lr=lr, weight_decay=WD, betas=list(BETAS), eps=EPS, grad_clip=clip
    )


# The product step and the variants measured against it (build_train_step keyword arguments).
LONGBOAT_VARIANTS: dict[str, dict[str, Any]] = {
    "longboat": {},
    "longboat_compiled": {"compile_layers": True},
    "longboat_graphed": {"cuda_graph": True},
    # an fp32 grad buffer where the product uses a bf16 one (no cast pass, +1.8 GB)
    "longboat_fp32grads": {"grad_buffer": "fp32"},
    # + megatron's non-distributed optimizer (nothing is sharded at DP=1 anyway)
    "longboat_localopt": {"grad_buffer": "fp32", "distributed_optimizer": False},
    # the update as one kernel pass per shard (llm.one_pass_adamw), eager and graphed
    "longboat_onepass": {"one_pass_adamw": True},
    "longboat_graphed_onepass": {"cuda_graph": True, "one_pass_adamw": True},
    # without the fused residual-add + RMSNorm (the separate add and norm kernels)
    "longboat_no_addnorm": {"kernel_options": {"add_rms_norm": False}},
}


def product_setup(
    c: dict[str, int], acc: Any, **variant: Any
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The step ``longboat-llm train`` runs (``longboat.llm.train.train_step``): longboat's
    layer spec (SDPA attention, Triton RMSNorm / SwiGLU / fused QKV-split RoPE), weights
    initialised on the device, megatron DDP + distributed optimizer with fused AdamW, wgrad
    GEMMs accumulating into the grad buffer, fused linear cross-entropy, no host sync."""
    from longboat.llm.train.train_step import build_train_step

    init_megatron(acc)
    notes: dict[str, Any] = {"attention": pick_attention_backend(c, acc)}
    ts = build_train_step(
        llm_config(c, "longboat"),
        product_optim(),
        precision="bf16",
        device=acc.device(),
        **variant,
    )
    cfg0 = ts.chunks[0].config
    notes["levers"] = {
        "gradient_accumulation_fusion": bool(cfg0.gradient_accumulation_fusion),
        "fused_linear_ce": ts.fused_linear_ce,
        **variant,
    }
    if not variant.get("cuda_graph"):
        return ts.step, notes
    step = ts.graphed(acc, warmup=3)
    notes["cuda_graph"] = step.graph.reason or "whole step as one CUDA graph"
    return step, notes


def mcore_setup(c: dict[str, int], acc: Any) -> tuple[Callable[..., Any], dict[str, Any]]:
    """Upstream megatron-core: ``GPTModel`` with megatron's local layer spec (unfused
    attention, torch norms), loss from ``GPTModel``'s logits, megatron's own optimizer step."""
    from megatron.core.distributed import finalize_model_grads

    from longboat.llm.build import build_model

    init_megatron(acc)
    device = acc.device()
    overrides: dict[str, Any] = {}
    if device.type == "cuda":
        overrides["use_cpu_initialization"] = False  # init on the GPU: seconds, not minutes
    chunks = build_model(llm_config(c, "local"), precision="bf16", device_type=device.type,
                         **overrides)  # fmt: skip
    ddp, opt = megatron_optimizer(chunks, device)
    net = ddp[0]
    pos = torch.arange(c["seq"], device=device).unsqueeze(0).expand(c["micro_batch"], -1)

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        net.zero_grad_buffer()
        opt.zero_grad()
        loss = net(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        finalize_model_grads(ddp)
        opt.step()
        return loss.detach()

    step.keep = (chunks, ddp, opt)  # type: ignore[attr-defined]
    return step, {}


# ----------------------------------------------------------------------------- driver


@contextlib.contextmanager
def time_limit(seconds: float):  # type: ignore[no-untyped-def]
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise RunTimeout(f"run exceeded its {seconds:.0f}s budget")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_one(name: str, c: dict[str, int], acc: Any, args: argparse.Namespace) -> dict[str, Any]:
    device = acc.device()
    gc.collect()
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    # Left over from earlier runs (should be ~0): it would count in this run's peak.
    leftover = acc.memory_stats().get("allocated_gb", 0.0)
    notes: dict[str, Any] = {}
    if name in ("hf_eager", "hf_compiled"):
        step = hf_setup(c, device, compiled=name == "hf_compiled")
    elif name == "hf_liger":
        step = hf_setup(c, device, compiled=False, liger=True)
    elif name == "mcore_local_spec":
        step, notes = mcore_setup(c, acc)
    elif name in LONGBOAT_VARIANTS:
        step, notes = product_setup(c, acc, **LONGBOAT_VARIANTS[name])
    else:
        raise ValueError(f"unknown run {name!r}; use one of {ALL_RUNS}")
    notes["allocated_at_start_gb"] = round(leftover, 3)
    build_s = time.perf_counter() - t0
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    n_batches = 4  # rotate a few batches so no step reuses the previous one's input
    seqs = torch.randint(0, c["vocab"], (n_batches, c["micro_batch"], c["seq"] + 1), generator=gen)
    batches = [(s[:, :-1].to(device), s[:, 1:].to(device)) for s in seqs]
    losses: list[float] = []
    clock = StepClock(acc, sync_every_step=args.sync_every_step)
    t0 = time.perf_counter()
    for i in range(args.warmup + args.steps):
        tokens, labels = batches[i % n_batches]
        if i == args.warmup:
            clock.start()
        if i >= args.warmup:
            clock.before_step()
        loss = step(tokens, labels)
        if i >= args.warmup:
            clock.mark()
        losses.append(loss)  # a device tensor: read after the loop (no sync inside a step)
    window_s = clock.stop()
    times = clock.step_times()
    total_s = time.perf_counter() - t0
    profile = profile_steps(
        acc,
        lambda i, fn=step, bs=batches: fn(*bs[i % n_batches]),
        args.profile_steps,
        args.profile_dir and args.profile_dir / f"llm_profile_{name}.txt",
        title=f"llm_throughput {name}",
    )
    if profile:
        notes["profile"] = profile
    losses_f = [float(x) for x in losses]
    med = statistics.median(times)
    tokens_per_s = c["micro_batch"] * c["seq"] / med
    mem = acc.memory_stats()
    del step, batches
    return {
        "name": name,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token(c) / PEAK_BF16_FLOPS,
        "peak_mem_gb": mem.get("peak_allocated_gb", 0.0),
        "median_step_s": med,
        "window_tokens_per_s": c["micro_batch"] * c["seq"] * len(times) / window_s,
        "step_times_s": times,
        "losses": losses_f,
        "build_s": build_s,
        "warmup_plus_timed_s": total_s,
        "notes": notes,
    }


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    base = next((r for r in runs if r["name"] == "hf_compiled" and "tokens_per_s" in r), None)
    lines = [
        "| run | tokens/s | vs hf_compiled | MFU | peak mem (GB) | median step (s) "
        "| window tokens/s | last loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if "tokens_per_s" not in r:
            err = str(r.get("error", "?")).splitlines()[0][:90].replace("|", "/")
            lines.append(f"| {r['name']} | failed: {err} | | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['name']} | {r['tokens_per_s'] / 1e3:.1f}k | {ratio} | {r['mfu']:.1%} | "
            f"{r['peak_mem_gb']:.1f} | {r['median_step_s']:.3f} | "
            f"{r.get('window_tokens_per_s', float('nan')) / 1e3:.1f}k | {r['losses'][-1]:.3f} |"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = [r for r in result["runs"] if "tokens_per_s" in r]
    if not runs:
        return
    names = [r["name"] for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    a1.bar(names, [r["tokens_per_s"] / 1e3 for r in runs], color="tab:blue")
    a1.set_ylabel("tokens/s (thousands)")
    a1.tick_params(axis="x", rotation=20)
    a2.bar(names, [r["peak_mem_gb"] for r in runs], color="tab:orange")
    a2.set_ylabel("peak memory (GB)")
    a2.tick_params(axis="x", rotation=20)
    cfg = result["config"]
    fig.suptitle(
        f"llm_throughput {result['date']} {result['gpu']}: {cfg['params'] / 1e6:.0f}M params, "
        f"seq {cfg['seq']}, micro-batch {cfg['micro_batch']}, bf16"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict[str, Any], args: argparse.Namespace) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if args.results_dir is None:
        return
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / f"llm_throughput_{result['date']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    cfg = result["config"]
    head = (
        f"# llm_throughput {result['date']}\n\n{result['gpu']}, commit {result['commit']}, "
        f"versions {json.dumps(result['versions'])}\n\n"
        f"Llama-style {cfg['params'] / 1e6:.0f}M params (hidden {cfg['hidden']}, "
        f"{cfg['layers']} layers, {cfg['heads']} heads / {cfg['kv_heads']} KV, SwiGLU "
        f"{cfg['ffn']}, vocab {cfg['vocab']}), seq {cfg['seq']}, micro-batch "
        f"{cfg['micro_batch']}, bf16, fused AdamW; median of {cfg['steps']} steps after "
        f"{cfg['warmup']} warm-up ({cfg.get('timing', 'synchronize per step')}). "
        f"MFU = tokens/s x ({cfg['flops_formula']}) / 989 TFLOP/s.\n\n"
    )
    stem.with_suffix(".md").write_text(head + table(result) + "\n")
    plot(result, stem.with_suffix(".png"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", default=None, help=f"comma list out of {','.join(ALL_RUNS)}")
    p.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="also write llm_throughput_<date>.{json,md,png} here (e.g. benchmarks/results)",
    )
    p.add_argument("--time-budget", type=float, default=0, help="seconds for all runs (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-steps", type=int, default=0, help="profiled steps after timing")
    p.add_argument("--profile-dir", type=Path, default=None, help="where profile tables go")
    p.add_argument(
        "--sync-every-step",
        action="store_true",
        help="synchronize before and after every timed step (the method of results before "
        "2026-11-30) instead of timing back-to-back steps with device events",
    )
    args = p.parse_args(argv)
    t_start = time.perf_counter()

    acc = get_accelerator()
    on_gpu = acc.device_type != "cpu"
    c = dict(TINY if args.tiny else FULL)
    default_runs = ALL_RUNS if on_gpu else ("hf_eager", "mcore_local_spec", "longboat")
    # A peer that is not installed is not a failure of the run.
    if args.runs is None and importlib.util.find_spec("liger_kernel") is None:
        default_runs = tuple(r for r in default_runs if r != "hf_liger")
    runs = args.runs.split(",") if args.runs else list(default_runs)
    result: dict[str, Any] = {
        "benchmark": "llm_throughput",
        "date": DATE,
        "gpu": gpu_name() if on_gpu else "cpu",
        "versions": versions("transformers", "triton", "megatron-core"),
        "commit": git_commit(),
        "config": {
            **c,
            "flavor": "tiny" if args.tiny else "886m",
            "params": param_count(c),
            "precision": "bf16",
            "optimizer": "AdamW fused (torch), no grad clipping",
            "steps": args.steps,
            "warmup": args.warmup,
            "timing": StepClock(acc, sync_every_step=args.sync_every_step).method,
            "flops_per_token": flops_per_token(c),
            "flops_formula": "6*N + 6*L*seq*heads*head_dim",
            "peak_flops": PEAK_BF16_FLOPS,
        },
        "runs": [],
    }
    for i, name in enumerate(runs):
        left = args.time_budget - (time.perf_counter() - t_start) if args.time_budget else 0
        if args.time_budget and left < 20:
            result["runs"].append({"name": name, "error": "skipped: time budget spent"})
            continue
        # Split what is left over the remaining runs by how long each is expected to take
        # (whole-model compile of HF is the longest, then the per-layer compile).
        weights = [RUN_WEIGHT.get(r, 1.0) for r in runs[i:]]
        budget = left * weights[0] / sum(weights) if args.time_budget else 0
        print(f"== {name} (budget {budget:.0f}s)", flush=True)
        try:
            with time_limit(budget):
                r = run_one(name, c, acc, args)
            print(
                f"   {r['tokens_per_s']:.0f} tokens/s, peak {r['peak_mem_gb']:.1f} GB, "
                f"build {r['build_s']:.1f}s, loop {r['warmup_plus_timed_s']:.1f}s {r['notes']}",
                flush=True,
            )
        except Exception as exc:
            traceback.print_exc()
            r = {"name": name, "error": f"{type(exc).__name__}: {exc}"}
        result["runs"].append(r)
        gc.collect()
        acc.empty_cache()
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
        write(result, args)  # partial results survive a kill
    os.environ.pop("LONGBOAT_ATTENTION_BACKEND", None)
    teardown_megatron()
    result["wall_s"] = time.perf_counter() - t_start
    write(result, args)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
