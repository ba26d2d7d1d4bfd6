"""FP8 linears vs bf16 at the llm benchmark's GEMM shapes: time, numerics, the adaptive choice.

    python tools/bench/fp8_gemm.py [--shapes 886m,qwen3_1_7b] [--recipes blockwise,rowwise,tensorwise]
        [--iters 20] [--warmup 5] [--results-dir benchmarks/results] [--out results.json]
    python tools/bench/fp8_gemm.py --smoke          # tiny shapes on CPU (emulated GEMMs)
    python tools/bench/fp8_gemm.py --glu --shapes qwen3_1_7b   # SwiGLU -> FP8 fusion rows

Shapes: the linears of one decoder layer of ``llm_throughput.py``'s shapes (tokens M = seq x
micro-batch; ``qkv`` ``[(heads + 2 kv) x head_dim, hidden]``, ``proj``, ``fc1`` (gate + up),
``fc2``). Per linear and per option (``bf16``: the same autograd function with bf16 GEMMs;
each FP8 recipe of ``longboat.kernels.fp8``):

- ``fwd+bwd ms``: median of one forward + backward (dx and dW), accelerator events,
  quantisation included (``measure_linear``, what the adaptive recipe measures);
- ``gemm ms``: the forward GEMM alone on operands quantised beforehand (FP8: ``fp8_mm``;
  bf16: ``torch.mm``), which separates the GEMM from the quantisation it needs;
- ``err y / dx / dW``: ``||out - ref|| / ||ref||`` against the fp32 product of the same bf16
  inputs (bf16's own error in the ``bf16`` row);
- the layer total (the four linears summed) and its speed-up over bf16, and the choice the
  adaptive recipe makes per shape (FP8 where it is >= 5% faster, ``adaptive.choose``).

Writes ``<results-dir>/fp8_gemm_<date>.{json,md}`` and prints the table. The end-to-end row
is ``llm_throughput.py``'s ``longboat_fp8*`` runs (printed below the table as a command).

``--glu``: instead, the MLP's SwiGLU fused into the FP8 down projection (blockwise) vs the
unfused pair, at each shape's MLP (tokens x ffn; the Qwen3-1.7B shape: 8192 x 6144), in well
under a minute: ``swiglu + quantize_dual`` (two kernels, the activation written in bf16 and
read back) vs ``glu_quantize_dual`` (one kernel writing only the FP8 operands; at its
default warps and at 8): ms, the bytes each moves and the HBM GB/s that makes; ``fc2 fwd+bwd`` (the SwiGLU, the down
projection's three FP8 GEMMs and their quantisation, the SwiGLU's backward): ``fp8_linear(
swiglu(h))`` vs ``fp8_glu_linear(h)``; and whether the two give equal FP8 codes, scales,
outputs and gradients (they must, bit for bit). Writes ``fp8_glu_<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import bench_env as env
import torch
from bench_env import fmt, md_table

from longboat.core.device import get_accelerator
from longboat.kernels.fp8 import (
    HIGH_PRECISION,
    RECIPES,
    choose,
    fp8_linear,
    fp8_mm,
    get_recipe,
    high_precision_linear,
    measure_linear,
    quantize,
)

MODELS = {
    # name: (hidden, heads, kv heads, head_dim, ffn, tokens = seq x micro-batch)
    "886m": (2048, 16, 8, 128, 5632, 2048 * 8),
    "qwen3_1_7b": (2048, 16, 8, 128, 6144, 4096 * 2),
}
SMOKE = {"tiny": (128, 2, 1, 64, 192, 128)}
E2E_COMMAND = (
    "python tools/bench/llm_throughput.py --shape {shape} --runs "
    "longboat,longboat_fp8,longboat_fp8_rowwise,longboat_fp8_tensorwise,longboat_fp8_adaptive "
    "--steps 20 --warmup 5"
)


def layer_linears(model: tuple[int, ...]) -> dict[str, tuple[int, int, int]]:
    """The (M, N, K) of each linear of one decoder layer."""
    hidden, heads, kv, head_dim, ffn, tokens = model
    return {
        "qkv": (tokens, (heads + 2 * kv) * head_dim, hidden),
        "proj": (tokens, hidden, heads * head_dim),
        "fc1": (tokens, 2 * ffn, hidden),
        "fc2": (tokens, hidden, ffn),
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def numerics(shape: tuple[int, int, int], name: str, device: torch.device) -> dict[str, float]:
    """Relative errors of y, dx, dW against the fp32 products of the same bf16 inputs."""
    m, n, k = shape
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(m, k, device=device, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(n, k, device=device, generator=gen) * k**-0.5).bfloat16().requires_grad_()
    dy = torch.randn(m, n, device=device, generator=gen).bfloat16()
    y = high_precision_linear(x, w) if name == HIGH_PRECISION else fp8_linear(x, w, recipe=name)
    y.backward(dy)
    xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
    return {
        "err_y": rel(y.detach(), xf @ wf.t()),
        "err_dx": rel(x.grad, dyf @ wf),
        "err_dw": rel(w.grad, dyf.t() @ xf),
    }


def gemm_only_ms(shape: tuple[int, int, int], name: str, device: torch.device, iters: int) -> float | None:  # fmt: skip
    """Median ms of the forward GEMM alone (operands quantised beforehand)."""
    if device.type != "cuda":
        return None
    m, n, k = shape
    x = torch.randn(m, k, device=device).bfloat16()
    w = torch.randn(n, k, device=device).bfloat16()
    if name == HIGH_PRECISION:
        run = lambda: torch.mm(x, w.t())  # noqa: E731
    else:
        r = get_recipe(name)
        qx, qw = quantize(x, r.activation, r.fwd_dtype), quantize(w, r.weight, r.fwd_dtype)
        run = lambda: fp8_mm(qx, qw)  # noqa: E731
    return _median_ms(run, iters)


def bench_model(model_name: str, model: tuple[int, ...], names: list[str], args: Any, device: torch.device) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for linear, shape in layer_linears(model).items():
        try:
            timings = measure_linear(
                shape, names, device=device, warmup=args.warmup, iters=args.iters
            )
        except Exception as exc:  # a recipe this torch / GPU lacks: recorded, not raised
            rows.append({"model": model_name, "linear": linear, "shape": list(shape),
                         "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
            continue
        choice = choose(timings)
        for name in names:
            row = {"model": model_name, "linear": linear, "shape": list(shape), "option": name,
                   "fwd_bwd_ms": timings[name], "speedup": timings[HIGH_PRECISION] / timings[name],
                   "gemm_ms": gemm_only_ms(shape, name, device, args.iters),
                   "adaptive_choice": choice}  # fmt: skip
            row.update(numerics(shape, name, device))
            rows.append(row)
    return rows


def layer_totals(rows: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per model and option: the four linears' fwd+bwd summed, and the adaptive mix."""
    out = []
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model and "option" in r]
        total = {n: sum(r["fwd_bwd_ms"] for r in mine if r["option"] == n) for n in names}
        best = {}
        for r in mine:
            if r["option"] == r["adaptive_choice"]:
                best[r["linear"]] = r["fwd_bwd_ms"]
        total["adaptive"] = sum(best.values())
        for n, ms in total.items():
            out.append({"model": model, "option": n, "layer_ms": ms,
                        "speedup": total[HIGH_PRECISION] / ms if ms else None})  # fmt: skip
    return out


def render(rows: list[dict[str, Any]], totals: list[dict[str, Any]]) -> str:
    head = ["model", "linear", "M x N x K", "option", "fwd+bwd ms", "vs bf16", "gemm ms",
            "err y", "err dx", "err dW", "adaptive"]  # fmt: skip
    body = []
    for r in rows:
        shape = " x ".join(map(str, r["shape"]))
        if "error" in r:
            body.append([r["model"], r["linear"], shape, f"failed: {r['error'][:80]}",
                         *[""] * 7])  # fmt: skip
            continue
        body.append([r["model"], r["linear"], shape, r["option"], fmt(r["fwd_bwd_ms"]),
                     fmt(r["speedup"], ".2f", suffix="x"), fmt(r["gemm_ms"]),
                     fmt(r["err_y"], ".2e"), fmt(r["err_dx"], ".2e"), fmt(r["err_dw"], ".2e"),
                     r["adaptive_choice"]])  # fmt: skip
    table = md_table(head, body)
    per_layer = md_table(
        ["model", "option", "4 linears fwd+bwd ms", "vs bf16"],
        [[t["model"], t["option"], fmt(t["layer_ms"]), fmt(t["speedup"], ".2f", suffix="x")]
         for t in totals],
    )  # fmt: skip
    return table + "\n\nOne decoder layer's linears:\n\n" + per_layer


def _median_ms(run: Any, iters: int, warmup: int = 3) -> float:
    """Median ms of ``run()`` by accelerator events (wall clock off CUDA)."""
    import time

    for _ in range(warmup):
        run()
    acc = get_accelerator()
    times = []
    for _ in range(iters):
        if acc.device().type != "cuda":
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = acc.event(enable_timing=True), acc.event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench_glu(model_name: str, model: tuple[int, ...], iters: int, device: torch.device) -> list[dict[str, Any]]:  # fmt: skip
    """The SwiGLU -> FP8 fusion rows of one shape's MLP (module doc, ``--glu``)."""
    from longboat.kernels.fp8.glu_linear import fp8_glu_linear, fused_applies
    from longboat.kernels.fp8.glu_quant import glu_quantize_dual
    from longboat.kernels.fp8.quantize import quantize_dual
    from longboat.kernels.swiglu import swiglu

    hidden, _, _, _, ffn, tokens = model
    gen = torch.Generator(device=device).manual_seed(1)
    h = torch.randn(tokens, 2 * ffn, device=device, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(hidden, ffn, device=device, generator=gen) * ffn**-0.5).bfloat16()
    w.requires_grad_()
    dy = torch.randn(tokens, hidden, device=device, generator=gen).bfloat16()
    fused = fused_applies(h, w, get_recipe("blockwise"), "scaled_mm" if h.is_cuda else "emulated")

    def quant_unfused() -> Any:
        return quantize_dual(swiglu(h.detach()))

    def quant_fused() -> Any:
        return glu_quantize_dual(h.detach())

    def quant_fused_8_warps() -> Any:
        return glu_quantize_dual(h.detach(), num_warps=8)

    def step(fn: Any) -> Any:
        def run() -> Any:
            h.grad = w.grad = None
            y = fn()
            y.backward(dy)
            return y, h.grad, w.grad

        return run

    lin_unfused = step(lambda: fp8_linear(swiglu(h), w))
    lin_fused = step(lambda: fp8_glu_linear(h, w))
    same_ops = all(
        torch.equal(a.scale, b.scale) and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        for fn in (quant_fused, quant_fused_8_warps)
        for a, b in zip(quant_unfused(), fn(), strict=True)
    )  # fmt: skip
    want = [t.clone() for t in lin_unfused()]
    got = lin_fused()
    same_grads = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    mf = tokens * ffn
    scale_bytes = 4 * (mf // 128) * 2  # fp32 scales of both operands
    fused_bytes = mf * (4 + 2) + scale_bytes
    moved = {"unfused": mf * (4 + 2 + 2 + 2) + scale_bytes, "fused": fused_bytes,
             "fused, 8 warps": fused_bytes}  # fmt: skip
    rows = []
    for what, runs in (
        ("swiglu -> fp8 operands", {"unfused": quant_unfused, "fused": quant_fused,
                                    "fused, 8 warps": quant_fused_8_warps}),
        ("fc2 fwd+bwd (swiglu included)", {"unfused": lin_unfused, "fused": lin_fused}),
    ):  # fmt: skip
        ms = {k: _median_ms(r, iters) for k, r in runs.items()}
        for k in runs:
            row = {"model": model_name, "what": what, "shape": [tokens, 2 * ffn, hidden],
                   "path": k, "ms": ms[k], "speedup": ms["unfused"] / ms[k],
                   "fused_kernel_ran": fused, "equal_operands": same_ops,
                   "equal_outputs_and_grads": same_grads}  # fmt: skip
            if what.startswith("swiglu"):
                row["bytes"] = moved[k]
                row["gb_per_s"] = moved[k] / ms[k] / 1e6
            rows.append(row)
    return rows


def render_glu(rows: list[dict[str, Any]]) -> str:
    head = ["model", "what", "tokens x 2ffn x hidden", "path", "ms", "vs unfused", "MB moved",
            "GB/s", "fused kernel ran", "bit-equal"]  # fmt: skip
    body = [[r["model"], r["what"], " x ".join(map(str, r["shape"])), r["path"], fmt(r["ms"]),
             fmt(r["speedup"], ".2f", suffix="x"),
             fmt(r["bytes"] / 1e6, ".0f") if "bytes" in r else "",
             fmt(r["gb_per_s"], ".0f") if "gb_per_s" in r else "", str(r["fused_kernel_ran"]),
             str(r["equal_operands"] and r["equal_outputs_and_grads"])]
            for r in rows]  # fmt: skip
    return md_table(head, body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="886m,qwen3_1_7b")
    ap.add_argument("--recipes", default=",".join(sorted(RECIPES)))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (emulated)")
    ap.add_argument("--glu", action="store_true", help="the SwiGLU -> FP8 fusion rows only")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--results-dir", type=Path, default=env.REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    acc = get_accelerator()
    device = acc.device()
    if args.smoke:
        models, args.iters, args.warmup = SMOKE, 2, 1
    else:
        if not acc.supports_fp8:
            print(f"fp8_gemm: {acc.device_name()} has no FP8 matmuls; use --smoke on CPU")
            return 2
        models = {name: MODELS[name] for name in args.shapes.split(",")}
    if args.glu:
        rows = [r for n, m in models.items() for r in bench_glu(n, m, args.iters, device)]
        table = render_glu(rows)
        result = env.result_meta("fp8_glu", device.type == "cuda", ["triton"], {
            k: str(v) for k, v in vars(args).items()})  # fmt: skip
        result["runs"] = rows
        env.write_results(
            result, out=args.out, results_dir=None if args.smoke else args.results_dir,
            stem=f"fp8_glu_{env.DATE}", table=table,
        )  # fmt: skip
        print(table)
        return 0
    names = [HIGH_PRECISION, *args.recipes.split(",")]
    rows: list[dict[str, Any]] = []
    for name, model in models.items():
        rows += bench_model(name, model, names, args, device)
    totals = layer_totals(rows, names)
    table = render(rows, totals)
    result = env.result_meta("fp8_gemm", device.type == "cuda", ["triton"], vars(args) | {
        "shapes": {n: layer_linears(m) for n, m in models.items()}})  # fmt: skip
    result["config"] = {k: str(v) for k, v in result["config"].items()}
    result["runs"], result["layer_totals"] = rows, totals
    commands = "\n".join(E2E_COMMAND.format(shape=s) for s in models if s in MODELS)
    note = "End to end (train.precision=fp8 in the llm stack):\n\n" + commands if commands else ""
    env.write_results(
        result, out=args.out, results_dir=None if args.smoke else args.results_dir,
        stem=f"fp8_gemm_{env.DATE}", table=table, note=note,
    )  # fmt: skip
    print(table)
    if note:
        print("\n" + note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
