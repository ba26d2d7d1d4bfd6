"""Kernel benchmark: torch eager vs torch.compile vs Liger vs longboat, forward + backward.

    python tools/bench/kernels.py --out results.json [--results-dir benchmarks/results]

Per kernel at training shapes (16k tokens): median fwd+bwd time of each implementation
(``triton.testing.do_bench``: warm-up, L2 flushed between runs, median), achieved GB/s from
the fewest bytes the op must move (each input read once, each output written once, fwd + bwd)
against the measured device-to-device copy bandwidth, and peak memory above the inputs.
Fused linear cross-entropy is compute-bound: it reports TFLOP/s and peak memory instead.
Writes ``<results-dir>/kernels_<date>.{json,md,png}`` plus ``--out``; prints the table last.
``--smoke`` runs tiny shapes on CPU to check the harness itself.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_env import git_commit, versions, write_results
from bench_env import gpu_name as _gpu_name

from longboat import kernels as K
from longboat.core.device import get_accelerator

REPO = Path(__file__).resolve().parents[2]
Fn = Callable[..., Any]


ACC = get_accelerator()


def mem_gb() -> tuple[float, float]:
    """(allocated, peak allocated) in GB on the accelerator; zeros on CPU."""
    if ACC.device_type == "cpu":
        return 0.0, 0.0
    s = ACC.memory_stats()
    return s["allocated_gb"], s["peak_allocated_gb"]


def bench_graph_ms(fn: Fn, rep_ms: int) -> float | None:
    """Device time of ``fn`` replayed from a CUDA graph (no CPU launch overhead), or None."""
    if DEVICE == "cpu":
        return None
    from triton.testing import do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    except Exception as exc:  # e.g. a host sync inside fn: not capturable
        print(f"[kernels bench] graph capture failed: {exc!r}"[:300], flush=True)
        return None


def bench_ms(fn: Fn, rep_ms: int) -> float:
    """Median milliseconds of ``fn`` launched from Python (>= 10 timed runs)."""
    if DEVICE == "cpu":
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[1]
    from triton.testing import do_bench

    fn()
    ACC.synchronize()
    t0 = time.perf_counter()
    fn()
    ACC.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    rep = max(rep_ms, int(12 * est))  # do_bench repeats ~rep/est times: keep >= 10 runs
    return float(do_bench(fn, warmup=max(25, int(3 * est)), rep=rep, return_mode="median"))


@dataclass
class Case:
    """One kernel at one shape: how to build inputs and each implementation."""

    name: str
    shape: str
    make: Callable[[], tuple[list[torch.Tensor], list[Any]]]  # (grad inputs, other args)
    impls: dict[str, Fn]
    bytes_moved: float | None = None  # fwd + bwd minimum traffic
    flops: float | None = None  # compute-bound cases
    notes: str = ""
    results: dict[str, Any] = field(default_factory=dict)


def _liger() -> dict[str, Any] | None:
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as exc:  # not carried, or incompatible with this triton
        print(f"[kernels bench] Liger unavailable: {exc!r}", flush=True)
        return None
    import importlib.metadata as md

    return {
        "version": md.version("liger-kernel"),
        "rms": LigerRMSNormFunction,
        "ln": LigerLayerNormFunction,
        "swiglu": LigerSiLUMulFunction,
        "geglu": LigerGELUMulFunction,
        "rope": LigerRopeFunction,
        "flce": LigerFusedLinearCrossEntropyFunction,
    }


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, tuple) else x


def build_cases(a: argparse.Namespace, liger: dict[str, Any] | None) -> list[Case]:
    dev, dt_ = DEVICE, torch.bfloat16
    m, h, inter = a.tokens, a.hidden, a.intermediate
    e = 2  # bytes per bf16 element

    def rnd(*shape: int, scale: float = 1.0, grad: bool = True) -> torch.Tensor:
        return (torch.randn(*shape, device=dev) * scale).to(dt_).requires_grad_(grad)

    cases: list[Case] = []
    mh = f"{m}x{h}"

    def rms_hf(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # HF LlamaRMSNorm
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    impls = {"eager": rms_hf, "longboat": lambda x, w: K.rms_norm(x, w, 1e-6, impl="triton")}
    if liger:
        impls["liger"] = lambda x, w: liger["rms"].apply(x, w, 1e-6, 0.0, "llama", False)
    cases.append(Case("rmsnorm", mh, lambda: ([rnd(m, h), rnd(h)], []), impls, 5 * m * h * e))

    def rms_res_eager(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor):  # type: ignore[no-untyped-def]
        hs = x + r
        return rms_hf(hs, w), hs

    impls = {
        "eager": rms_res_eager,
        "longboat": lambda x, r, w: K.rms_norm(x, w, 1e-6, r, impl="triton"),
    }
    make = lambda: ([rnd(m, h), rnd(m, h), rnd(h)], [])  # noqa: E731
    notes = "no Liger equivalent (fused residual add)"
    cases.append(Case("rmsnorm_residual", mh, make, impls, 8 * m * h * e, notes=notes))

    impls = {
        "eager": lambda x, w, b: F.layer_norm(x, (h,), w, b, 1e-5),
        "longboat": lambda x, w, b: K.layer_norm(x, w, b, 1e-5, impl="triton"),
    }
    if liger:
        impls["liger"] = lambda x, w, b: liger["ln"].apply(x, w, b, 1e-5)
    make = lambda: ([rnd(m, h), rnd(h), rnd(h)], [])  # noqa: E731
    cases.append(Case("layernorm", mh, make, impls, 5 * m * h * e))

    b_ada = max(1, m // a.seq)

    def ada_eager(x: torch.Tensor, sc: torch.Tensor, sh: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (h,), eps=1e-6) * (1 + sc[:, None]) + sh[:, None]

    impls = {
        "eager": ada_eager,
        "longboat": lambda x, sc, sh: K.ada_layer_norm(x, sc, sh, 1e-6, impl="triton"),
    }
    make = lambda: ([rnd(b_ada, a.seq, h), rnd(b_ada, h, scale=0.1), rnd(b_ada, h)], [])  # noqa: E731
    shape, moved = f"{b_ada}x{a.seq}x{h}", 5 * b_ada * a.seq * h * e
    cases.append(Case("adaln", shape, make, impls, moved, notes="no Liger equivalent"))

    gated = {
        "swiglu": (lambda g, u: F.silu(g) * u, K.swiglu),
        "geglu": (lambda g, u: F.gelu(g, approximate="tanh") * u, K.geglu),
    }
    for act, (eager, kernel) in gated.items():
        impls = {"eager": eager, "longboat": lambda g, u, k=kernel: k(g, u, impl="triton")}
        if liger:
            impls["liger"] = lambda g, u, fn=liger[act]: fn.apply(g, u)
        make = lambda: ([rnd(m, inter), rnd(m, inter)], [])  # noqa: E731
        cases.append(Case(act, f"{m}x{inter}", make, impls, 8 * m * inter * e))

    bsz, seq = max(1, m // a.seq), a.seq
    hq, hk, hd = a.heads, a.kv_heads, a.head_dim
    cos_h, sin_h = K.rope_cos_sin(seq, hd, device=dev)
    cos_f = torch.cat([cos_h, cos_h], -1).to(dt_)
    sin_f = torch.cat([sin_h, sin_h], -1).to(dt_)

    def rope_eager(q: torch.Tensor, k: torch.Tensor):  # type: ignore[no-untyped-def]
        c, s = cos_f[None, :, None, :], sin_f[None, :, None, :]

        def rot(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.chunk(2, -1)
            return torch.cat((-x2, x1), -1)

        return q * c + rot(q) * s, k * c + rot(k) * s

    impls = {
        "eager": rope_eager,
        "longboat": lambda q, k: K.apply_rope(q, k, cos_h, sin_h, impl="triton"),
    }
    if liger:
        impls["liger"] = lambda q, k: liger["rope"].apply(
            q.transpose(1, 2), k.transpose(1, 2), cos_f[None], sin_f[None]
        )
    make = lambda: ([rnd(bsz, seq, hq, hd), rnd(bsz, seq, hk, hd)], [])  # noqa: E731
    shape, moved = f"q {bsz}x{seq}x{hq}x{hd}, k {hk} heads", 4 * bsz * seq * (hq + hk) * hd * e
    cases.append(Case("rope", shape, make, impls, moved))

    for vocab in a.vocabs:

        def make(vocab: int = vocab) -> tuple[list[torch.Tensor], list[Any]]:
            t = torch.randint(0, vocab, (m,), device=dev)
            t[::10] = -100
            return [rnd(m, h), rnd(vocab, h, scale=0.02)], [t]

        def ce_eager(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy((x @ w.t()).float(), t, ignore_index=-100)

        impls = {
            "eager": ce_eager,
            "longboat": lambda x, w, t: K.fused_linear_cross_entropy(x, w, t, impl="triton"),
        }
        if liger:
            impls["liger"] = lambda x, w, t: _first(liger["flce"].apply(x, w, t))
        shape, flops = f"{m}x{h} @ {vocab}x{h}", 3 * 2.0 * m * vocab * h
        notes = "compute-bound; targets: peak <= 1/4 of unfused, time <= unfused"
        cases.append(
            Case(f"fused_linear_ce_v{vocab}", shape, make, impls, flops=flops, notes=notes)
        )
    return [c for c in cases if not a.only or c.name in a.only]


def run_case(case: Case, a: argparse.Namespace) -> None:
    torch.manual_seed(0)
    impls = dict(case.impls)
    if not a.no_compile:
        impls["compile"] = torch.compile(case.impls["eager"], dynamic=False)
    order = ["eager", "compile", "liger", "longboat"]
    for name in [n for n in order if n in impls]:
        fn = impls[name]
        inputs, extra = case.make()
        with torch.no_grad():
            probe = fn(*inputs, *extra)
        outs = probe if isinstance(probe, tuple) else (probe,)
        grads = [torch.randn_like(o) if o.dim() else None for o in outs]
        del probe, outs

        def step(fn: Fn = fn, inputs: list[torch.Tensor] = inputs, extra: list[Any] = extra,
                 grads: list[Any] = grads) -> None:  # fmt: skip
            out = fn(*inputs, *extra)
            out = out if isinstance(out, tuple) else (out,)
            torch.autograd.grad(out, inputs, grads)

        def fwd(fn: Fn = fn, inputs: list[torch.Tensor] = inputs, extra: list[Any] = extra) -> None:
            with torch.no_grad():
                fn(*inputs, *extra)

        try:
            t0 = time.perf_counter()
            step()  # compile / JIT here, outside the timing
            ACC.synchronize()
            warm_s = time.perf_counter() - t0
            wall_ms = bench_ms(step, a.rep_ms)
            memory_bound = case.bytes_moved is not None
            graph_ms = bench_graph_ms(step, a.rep_ms) if memory_bound else None
            fwd_ms = None
            if memory_bound:
                fwd_ms = bench_graph_ms(fwd, a.rep_ms) or bench_ms(fwd, a.rep_ms)
            ACC.synchronize()
            base, _ = mem_gb()
            ACC.reset_peak_memory_stats()
            step()
            ACC.synchronize()
            _, peak = mem_gb()
            case.results[name] = {
                "ms": graph_ms if graph_ms is not None else wall_ms,
                "timing": "cuda_graph" if graph_ms is not None else "events",
                "wall_ms": wall_ms,
                "fwd_ms": fwd_ms,
                "peak_mem_gb": max(0.0, peak - base),
                "first_call_s": warm_s,
            }
        except Exception as exc:  # one failing implementation must not hide the others
            case.results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"[kernels bench] {case.name}/{name} failed: {exc!r}", flush=True)
        del inputs, extra, grads
        ACC.empty_cache()
        print(f"[kernels bench] {case.name}/{name}: {case.results[name]}", flush=True)


def copy_bandwidth_gbs(size_gib: float) -> float:
    n = int(size_gib * 2**30) // 2
    src = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), 200)
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def summarize(case: Case, copy_gbs: float) -> dict[str, Any]:
    r = case.results

    def ms(name: str) -> float | None:
        return r.get(name, {}).get("ms")

    ours, comp, lig, eag = ms("longboat"), ms("compile"), ms("liger"), ms("eager")
    row: dict[str, Any] = {
        "name": case.name,
        "shape": case.shape,
        "eager_ms": eag,
        "compile_ms": comp,
        "liger_ms": lig,
        "longboat_ms": ours,
        "longboat_fwd_ms": r.get("longboat", {}).get("fwd_ms"),
        "wall_ms": {k: v.get("wall_ms") for k, v in r.items()},
        "timing": {k: v.get("timing") for k, v in r.items()},
        "speedup_vs_eager": eag / ours if eag and ours else None,
        "speedup_vs_compile": comp / ours if comp and ours else None,
        "speedup_vs_liger": lig / ours if lig and ours else None,
        "gb_per_s": None,
        "bandwidth_fraction": None,
        "peak_mem_gb": {k: v.get("peak_mem_gb") for k, v in r.items()},
        "errors": {k: v["error"] for k, v in r.items() if "error" in v},
        "notes": case.notes,
    }
    if case.bytes_moved and ours:
        row["gb_per_s"] = case.bytes_moved / (ours * 1e-3) / 1e9
        row["bandwidth_fraction"] = row["gb_per_s"] / copy_gbs if copy_gbs else None
        row["targets"] = {
            "bandwidth_ge_75pct": (row["bandwidth_fraction"] or 0) >= 0.75,
            "ge_1.2x_compile": (row["speedup_vs_compile"] or 0) >= 1.2,
            "ge_liger": None if lig is None else ours <= lig,
        }
    if case.flops and ours:
        row["tflop_per_s"] = case.flops / (ours * 1e-3) / 1e12
        peaks = row["peak_mem_gb"]
        unfused = peaks.get("eager") or math.inf  # the unfused loss as users write it
        row["targets"] = {
            "peak_le_quarter_unfused": peaks.get("longboat", math.inf) <= unfused / 4,
            "time_le_unfused": ours <= (eag or math.inf),
            "time_le_compile": None if comp is None else ours <= comp,
            "ge_liger": None if lig is None else ours <= lig,
        }
    return row


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "—" if v is None else format(v, spec)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    head = (
        "Kernels, fwd+bwd median ms (memory-bound kernels: CUDA-graph replay = device time; "
        "fused CE: CUDA events; wall = launched from Python, CPU overhead included), "
        f"{meta['gpu']}, torch {meta['versions']['torch']}, "
        f"triton {meta['versions']['triton']}, liger {meta['versions'].get('liger_kernel')}, "
        f"commit {meta['commit']}, copy bandwidth {meta['copy_bandwidth_gb_s']:.0f} GB/s\n\n"
    )
    cols = ("kernel | shape | eager | compile | liger | longboat | x compile | x liger | "
            "GB/s | % copy BW | wall ms compile/liger/longboat | peak GB eager/compile/liger/"
            "longboat | targets")  # fmt: skip
    lines = [f"| {cols} |", "|" + "---|" * len(cols.split("|"))]
    for r in rows:
        p = r["peak_mem_gb"]
        peaks = "/".join(_fmt(p.get(k), ".2f") for k in ("eager", "compile", "liger", "longboat"))
        walls = "/".join(_fmt(r["wall_ms"].get(k)) for k in ("compile", "liger", "longboat"))
        tg = r.get("targets", {})
        targets = " ".join(
            f"{k}:{'✓' if v else ('—' if v is None else '✗')}" for k, v in tg.items()
        )
        bw = (
            _fmt(r["gb_per_s"], ".0f")
            if r["gb_per_s"]
            else _fmt(r.get("tflop_per_s"), ".0f") + " TF/s"
        )
        frac = _fmt(100 * r["bandwidth_fraction"], ".0f") if r["bandwidth_fraction"] else "—"
        lines.append(
            f"| {r['name']} | {r['shape']} | {_fmt(r['eager_ms'])} | {_fmt(r['compile_ms'])} | "
            f"{_fmt(r['liger_ms'])} | {_fmt(r['longboat_ms'])} | "
            f"{_fmt(r['speedup_vs_compile'], '.2f')} | {_fmt(r['speedup_vs_liger'], '.2f')} | "
            f"{bw} | {frac} | {walls} | {peaks} | {targets} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]]) -> Any:
    def draw(plt: Any) -> Any:
        impls = ("eager", "compile", "liger", "longboat")
        fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(rows)), 4.5))
        for i, impl in enumerate(impls):
            vals = [(r["eager_ms"] / r[f"{impl}_ms"]) if r.get(f"{impl}_ms") and r["eager_ms"]
                    else 0 for r in rows]  # fmt: skip
            ax.bar([j + (i - 1.5) * 0.2 for j in range(len(rows))], vals, 0.2, label=impl)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=20, ha="right")
        ax.set_ylabel("speedup over torch eager (fwd+bwd)")
        ax.set_title("longboat kernels vs torch eager / torch.compile / Liger")
        ax.legend()
        fig.tight_layout()
        return fig

    return draw


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results.json"), help="JSON results path")
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--date", default=dt.date.today().isoformat())
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocabs", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--rep-ms", type=int, default=300, help="do_bench time budget per run")
    p.add_argument("--only", nargs="*", help="run only these case names")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-liger", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (harness check)")
    a = p.parse_args(argv)
    if a.smoke:
        a.tokens, a.hidden, a.intermediate, a.seq = 64, 96, 160, 32
        a.heads, a.kv_heads, a.head_dim, a.vocabs = 4, 2, 16, [300]
        a.no_compile, a.no_liger = True, True
    return a


DEVICE = "cpu"


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    a = parse_args(argv)
    DEVICE = "cpu" if a.smoke or not torch.accelerator.is_available() else "cuda"
    if DEVICE == "cpu" and not a.smoke:
        print("no GPU: run with --smoke for a harness check", file=sys.stderr)
        return 2
    liger = None if a.no_liger else _liger()
    copy_gbs = copy_bandwidth_gbs(0.05 if a.smoke else 4.0)
    print(f"[kernels bench] copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    cases = build_cases(a, liger)
    if a.smoke:  # references only on CPU: swap the forced-triton calls for the dispatch
        for c in cases:
            c.impls["longboat"] = c.impls["eager"]
    for case in cases:
        run_case(case, a)
    rows = [summarize(c, copy_gbs) for c in cases]
    meta = {
        "benchmark": "kernels",
        "date": a.date,
        "gpu": "cpu" if DEVICE == "cpu" else _gpu_name(),
        "versions": versions("triton", "liger-kernel"),
        "commit": git_commit(),
        "copy_bandwidth_gb_s": copy_gbs,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
    }
    result = {**meta, "runs": rows}
    table = markdown(rows, meta)
    write_results(result, out=a.out, results_dir=a.results_dir, stem=f"kernels_{a.date}",
                  table=table, plot=plot(rows))  # fmt: skip
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
