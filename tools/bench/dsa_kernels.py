"""DSA kernels at DeepSeek-V3.2's shape: sparse attention (forward, forward + backward) and the
lightning indexer's top-k, the package's kernels beside the previous ones.

    python tools/bench/dsa_kernels.py [--shape v32_32k] [--impls new,before] [--reps 3]
        [--row-budget-s 25] [--results-dir benchmarks/results] [--out results.json]
    TRITON_INTERPRET=1 python tools/bench/dsa_kernels.py --tiny     # the harness on CPU

Shape ``v32_32k`` is ``llm_throughput.py``'s: one sample of 32,768 tokens, MLA's absorbed
form (128 query heads of 576 = 512 latent + 64 rotary channels, one shared latent key, the
value its first 512 channels, a view of it as the model passes it), 2,048 keys a query,
chosen by the lightning indexer (64 heads of 128) from random inputs, causal. Rows:

- ``indexer_topk``: ``dsa.indexer_topk`` (scores in chunks of queries, ``torch.topk``);
- ``attention fwd`` / ``attention fwd+bwd`` per implementation (``new``: the package's
  ``dsa.sparse_attention``; ``before``: ``dsa_kernels_before.py``, the kernels the package had
  before, 16 heads a program with fp32 atomics for dq, dk and dv): median milliseconds over
  ``--reps`` timed runs after one warm-up (the first call compiles and autotunes), fewer where
  a run is slow (``--row-budget-s`` per row); TFLOP/s from the matmul FLOPs the math needs
  (forward 2 * s * h * topk * (dk + dv), backward 2 * s * h * topk * (3 dk + 2 dv)); GB/s
  from the bytes the op must move once (inputs, outputs, gradients) and, beside it, the key
  bytes the implementation gathers (its head block times the selected rows' bytes);
- the check: each implementation's output and gradients (dq and the key's gradient, which
  holds the value's) on the last 32 queries (2,048 keys each) against the dense masked torch
  reference of the same slice, ``||got - ref|| / ||ref||`` (bf16: within 2e-2 passes).

Every row is guarded: an error is recorded and printed on its row, the others still run.
Writes ``<results-dir>/dsa_kernels_<date>.{json,md}`` (not with ``--tiny``) and ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_env as env
import torch
from bench_env import fmt, md_table

from longboat.core.device import get_accelerator
from longboat.kernels import dsa

SHAPES = {
    # b, s, heads, dk, dv, topk, index heads, index head dim
    "v32_32k": (1, 32768, 128, 576, 512, 2048, 64, 128),
    "tiny": (1, 24, 18, 40, 24, 17, 2, 16),
}
CHECK_QUERIES = {"v32_32k": 32, "tiny": 4}
TOL_BF16 = 2e-2
ACC = get_accelerator()


def attention_impls() -> dict[str, Callable[..., torch.Tensor]]:
    """name -> ``f(q, k, v, indices, scale)`` with autograd."""
    from dsa_kernels_before import sparse_attention_before

    return {
        "new": lambda q, k, v, i, sc: dsa.sparse_attention(q, k, v, i, sc, impl="triton"),
        "before": sparse_attention_before,
    }


def tuned_configs() -> dict[str, str]:
    """The tile configuration the autotuner chose for each of the package's kernels."""
    mod = sys.modules.get("longboat.kernels.dsa.sparse_attention")
    out = {}
    for name in ("_sparse_attn_fwd_kernel", "_sparse_attn_bwd_kernel"):
        best = getattr(getattr(mod, name, None), "best_config", None)
        if best is not None:
            out[name.strip("_")] = (
                f"{best.kwargs}, num_warps={best.num_warps}, num_stages={best.num_stages}"
            )
    return out


def new_head_block(kind: str) -> int | None:
    mod = sys.modules.get("longboat.kernels.dsa.sparse_attention")
    name = "_sparse_attn_fwd_kernel" if kind == "fwd" else "_sparse_attn_bwd_kernel"
    best = getattr(getattr(mod, name, None), "best_config", None)
    return None if best is None else int(best.kwargs["BLOCK_H"])


def timed(fn: Callable[[], Any], reps: int, budget_s: float) -> tuple[list[float], float]:
    """(milliseconds of each timed run, peak GB above the start): one warm-up run, then up
    to ``reps`` runs while they fit ``budget_s``."""
    ACC.synchronize()
    start_gb = ACC.memory_stats().get("allocated_gb", 0.0)
    ACC.reset_peak_memory_stats()
    t0 = time.perf_counter()
    fn()
    ACC.synchronize()
    first = time.perf_counter() - t0
    times: list[float] = []
    spent = first
    for _ in range(reps):
        if times and spent + times[-1] / 1e3 > budget_s:
            break
        if ACC.device_type == "cpu":
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        else:
            begin, end = ACC.event(enable_timing=True), ACC.event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        spent += times[-1] / 1e3
    peak = ACC.memory_stats().get("peak_allocated_gb", 0.0) - start_gb
    return times, peak


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


class Problem:
    """Inputs of one shape on the device: the indexer's, the attention's, the indices."""

    def __init__(self, shape: str, device: torch.device) -> None:
        b, s, h, dk, dv, topk, ih, idim = SHAPES[shape]
        self.shape, self.dims = shape, (b, s, h, dk, dv, topk, ih, idim)
        gen = torch.Generator(device=device).manual_seed(0)

        def rnd(*size: int, scale: float = 1.0) -> torch.Tensor:
            x = torch.randn(*size, device=device, generator=gen, dtype=torch.float32)
            return (x * scale).to(torch.bfloat16)

        self.index_inputs = (rnd(b, s, ih, idim), rnd(b, s, idim), rnd(b, s, ih, scale=0.1))
        self.q = rnd(b, s, h, dk, scale=0.3)
        self.key = rnd(b, s, dk)
        self.dout = rnd(b, s, h, dv)
        self.scale = dk**-0.5
        self.indices: torch.Tensor | None = None

    def flops(self, kind: str) -> float:
        b, s, h, dk, dv, topk, *_ = self.dims
        fwd = 2.0 * b * s * h * topk * (dk + dv)
        bwd = 2.0 * b * s * h * topk * (3 * dk + 2 * dv)
        return fwd if kind == "fwd" else fwd + bwd

    def min_bytes(self, kind: str) -> float:
        """Bytes the op must move once: q, k, indices, output, log-sum-exp (and for the
        backward dO, dq, the key's gradient, q, k, output again)."""
        b, s, h, dk, dv, topk, *_ = self.dims
        fwd = 2 * b * s * h * (dk + dv) + 2 * b * s * dk + 8 * b * s * topk + 4 * b * s * h
        bwd = 2 * b * s * h * (2 * dk + 2 * dv) + 4 * b * s * dk + 8 * b * s * topk
        return float(fwd if kind == "fwd" else fwd + bwd)

    def gathered_bytes(self, kind: str, head_block: int | None, separate_value: bool) -> float | None:  # fmt: skip
        """Key (and value) row bytes the implementation gathers: per query and head block,
        every selected row; the backward gathers them again."""
        if head_block is None:
            return None
        b, s, h, dk, dv, topk, *_ = self.dims
        row = 2 * (dk + (dv if separate_value else 0))
        once = b * s * math.ceil(h / head_block) * topk * row
        return float(once if kind == "fwd" else 2 * once)


def run_indexer(p: Problem, args: argparse.Namespace) -> dict[str, Any]:
    b, s, _, _, _, topk, ih, idim = p.dims
    row: dict[str, Any] = {"name": "indexer_topk", "kind": "indexer", "impl": "new"}
    try:
        result: dict[str, torch.Tensor] = {}

        def call() -> None:
            result["idx"] = dsa.indexer_topk(*p.index_inputs, topk, impl="triton")

        times, peak = timed(call, args.reps, args.row_budget_s)
        p.indices = result["idx"]
        ms = median(times)
        flops = 2.0 * b * (s * (s + 1) / 2) * ih * idim  # causal half of the score matrix
        moved = 2 * b * s * (ih * idim + idim + ih) + 8 * b * s * topk + 8.0 * b * s * (s / 2)
        row.update(ms=ms, runs=len(times), tflops=flops / ms / 1e9, gbs=moved / ms / 1e6,
                   peak_gb=peak)  # fmt: skip
    except Exception as exc:  # recorded on its row; the attention rows fall back below
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    if p.indices is None:  # random causal keys so that the attention rows still run
        scores = torch.rand(b, s, s, device=p.q.device) if s <= 4096 else None
        if scores is None:
            raise RuntimeError("the indexer failed and no fallback selection at this size")
        scores = scores.masked_fill(~dsa.causal_key_mask(s, s, scores.device), -torch.inf)
        p.indices = dsa.select_topk(scores, topk)
    return row


def run_attention(p: Problem, impl: str, fn: Callable[..., torch.Tensor], kind: str,
                  args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {"name": f"attention {kind}", "kind": kind, "impl": impl}
    dv = p.dims[4]
    try:
        q = p.q.detach().requires_grad_(kind != "fwd")
        key = p.key.detach().requires_grad_(kind != "fwd")

        def call() -> None:
            q.grad = key.grad = None
            with torch.set_grad_enabled(kind != "fwd"):
                out = fn(q, key, key[..., :dv], p.indices, p.scale)
                if kind != "fwd":
                    out.backward(p.dout)

        times, peak = timed(call, args.reps, args.row_budget_s)
        ms = median(times)
        block = new_head_block(kind) if impl == "new" else 16
        gathered = p.gathered_bytes(kind, block, separate_value=impl == "before")
        row.update(ms=ms, runs=len(times), tflops=p.flops(kind) / ms / 1e9,
                   gbs=p.min_bytes(kind) / ms / 1e6, peak_gb=peak, head_block=block,
                   gathered_gb=None if gathered is None else gathered / 1e9)  # fmt: skip
        q.grad = key.grad = None
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    return row


def check_slice(p: Problem, impl: str, fn: Callable[..., torch.Tensor]) -> dict[str, Any]:
    """Output, dq and the key's gradient of the last queries against the dense reference."""
    row: dict[str, Any] = {"name": "check (last queries)", "kind": "check", "impl": impl}
    n, dv = CHECK_QUERIES[p.shape], p.dims[4]
    try:
        assert p.indices is not None
        idx = p.indices[:, -n:].contiguous()
        dout = p.dout[:, -n:].contiguous()
        grads = []
        for f in (fn, dsa.sparse_attention_torch):
            q = p.q[:, -n:].detach().clone().requires_grad_()
            key = p.key.detach().clone().requires_grad_()
            out = f(q, key, key[..., :dv], idx, p.scale)
            out.backward(dout)
            grads.append((out.detach(), q.grad, key.grad))
        (out, dq, dk), (r_out, r_dq, r_dk) = grads
        errs = {"err_out": rel(out, r_out), "err_dq": rel(dq, r_dq), "err_dk": rel(dk, r_dk)}
        row.update(errs, passed=max(errs.values()) <= TOL_BF16)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    return row


def render(rows: list[dict[str, Any]]) -> str:
    head = ["row", "impl", "ms", "TFLOP/s", "GB/s (once)", "gathered GB", "head block",
            "peak GB", "err out", "err dq", "err dk"]  # fmt: skip
    body = []
    for r in rows:
        if "error" in r:
            err = r["error"].splitlines()[0][:90].replace("|", "/")
            body.append([r["name"], r["impl"], f"failed: {err}", *[""] * (len(head) - 3)])
            continue
        body.append([r["name"], r["impl"], fmt(r.get("ms"), ".1f"), fmt(r.get("tflops"), ".1f"),
                     fmt(r.get("gbs"), ".0f"), fmt(r.get("gathered_gb"), ".0f"),
                     fmt(r.get("head_block"), "d"), fmt(r.get("peak_gb"), ".2f"),
                     fmt(r.get("err_out"), ".1e"), fmt(r.get("err_dq"), ".1e"),
                     fmt(r.get("err_dk"), ".1e")])  # fmt: skip
    return md_table(head, body)


def speedups(rows: list[dict[str, Any]]) -> list[str]:
    """``before / new`` per attention kind where both ran."""
    lines = []
    for kind in ("fwd", "fwd+bwd"):
        ms = {r["impl"]: r.get("ms") for r in rows if r["kind"] == kind and "error" not in r}
        if ms.get("new") and ms.get("before"):
            lines.append(f"attention {kind}: new {ms['new']:.1f} ms, before {ms['before']:.1f} "
                         f"ms, {ms['before'] / ms['new']:.1f}x")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="v32_32k", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU (the interpreter)")
    ap.add_argument("--impls", default="new,before")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--row-budget-s", type=float, default=25.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--results-dir", type=Path, default=env.REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    on_gpu = ACC.device_type != "cpu" and not args.tiny
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not on_gpu and not interpreted:
        print("dsa_kernels: on CPU run with TRITON_INTERPRET=1 and --tiny", file=sys.stderr)
        return 2
    shape = "tiny" if args.tiny else args.shape
    if args.tiny:  # the interpreter is slow: one timed run a row
        args.reps = 1
    device = ACC.device() if on_gpu else torch.device("cpu")
    impls = attention_impls()
    unknown = [n for n in args.impls.split(",") if n not in impls]
    if unknown:
        print(f"dsa_kernels: unknown --impls {unknown}; choose from {sorted(impls)}")
        return 2
    started = time.perf_counter()
    p = Problem(shape, device)
    rows = [run_indexer(p, args)]
    print(render(rows), flush=True)
    for name in args.impls.split(","):
        for kind in ("fwd", "fwd+bwd"):
            rows.append(run_attention(p, name, impls[name], kind, args))
            print(render(rows[-1:]).splitlines()[-1], flush=True)
        rows.append(check_slice(p, name, impls[name]))
        print(render(rows[-1:]).splitlines()[-1], flush=True)
    table = render(rows)
    lines = speedups(rows)
    meta = env.result_meta("dsa_kernels", on_gpu, ["torch", "triton"], vars(args) | {
        "dims": dict(zip(("b", "s", "heads", "dk", "dv", "topk", "index_heads",
                          "index_head_dim"), p.dims, strict=True))})  # fmt: skip
    meta["config"] = {k: str(v) for k, v in meta["config"].items()}
    meta["runs"], meta["tuned"] = rows, tuned_configs()
    meta["seconds"] = round(time.perf_counter() - started, 1)
    note = "\n".join([*lines, f"tuned: {meta['tuned']}"])
    env.write_results(meta, out=args.out, results_dir=None if args.tiny else args.results_dir,
                      stem=f"dsa_kernels_{shape}_{env.DATE}", table=table, note=note)  # fmt: skip
    print("\n" + table + "\n\n" + note)
    print(f"({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
