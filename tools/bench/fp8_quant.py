"""FP8 quantisation kernels at the llm benchmark's GEMM shapes: GB/s per kernel config, exact codes.

    python tools/bench/fp8_quant.py [--shapes qwen3_1_7b] [--entries dual,groups,blocks,blocks_t]
        [--configs r16w8-rows,old] [--iters 30] [--warmup 5] [--results-dir benchmarks/results]
        [--out results.json]
    TRITON_INTERPRET=1 python tools/bench/fp8_quant.py --tiny    # CPU smoke: correctness only

Entry points of ``longboat.kernels.fp8.quantize_triton`` and what the blockwise recipe feeds
them per linear ``(M, N, K)`` of one decoder layer (``fp8_gemm.layer_linears``):

- ``dual``: ``quantize_dual_triton``, the 1x128 operands of ``x`` ``[M, K]`` (forward) and
  ``dy`` ``[M, N]`` (backward) and of their transposes, from one program per 128 x 128 tile;
- ``groups``: ``quantize_triton(.., "1x128")``, the same activations quantised one way only;
- ``blocks``: ``quantize_triton(.., "128x128")``, the weight ``W`` ``[N, K]``;
- ``blocks_t``: ``quantize_blocks_transposed_triton``, ``W^T``'s 128x128 operand from ``W``.

Per entry and shape, every candidate of ``TILE_CONFIGS`` (the dual and blocks kernels; the
library's own ``DUAL_CONFIG`` / ``BLOCKS_CONFIG`` / ``BLOCKS_T_CONFIG`` marked ``*``) and ``old``, the kernels as
they were before they walked their tile in chunks (the whole 128 x 128 tile in fp32 at 8
warps, and Triton's approximate fp32 division, so its codes may differ from the reference
by a rounding step now and then; kept here as the baseline): the median of ``--iters`` timed calls (accelerator
events around each call, L2 flushed before it, after ``--warmup`` calls), GB/s against the
bytes the entry must move (bf16 read once, each FP8 output and fp32 scale written once),
its fraction of an H100 SXM's 3.35 TB/s, and whether codes and scales equal the torch
reference (``quantize_torch``) byte for byte. Then the winning config per entry and shape.

Writes ``<results-dir>/fp8_quant_<date>.{json,md}`` and prints the tables; exits 1 if any
result of the library's kernels differs from the reference or fails.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_env as env
import torch
from bench_env import fmt, md_table
from fp8_gemm import MODELS, layer_linears

from longboat.core.device import get_accelerator
from longboat.kernels._dispatch import triton_interpreter_on
from longboat.kernels._triton import tl, triton
from longboat.kernels.fp8.quantize import (
    AMAX_FLOOR,
    E4M3,
    Fp8Operand,
    fp8_max,
    quantize_torch,
    scale_storage_shape,
    scale_view,
)
from longboat.kernels.fp8.quantize_triton import (
    BLOCKS_CONFIG,
    BLOCKS_T_CONFIG,
    DUAL_CONFIG,
    TILE_CONFIGS,
    TileConfig,
    _grid_args,
    _round_to_grid,
    quantize_blocks_transposed_triton,
    quantize_dual_triton,
    quantize_triton,
)

HBM_BYTES_PER_S = 3.35e12
"""An H100 SXM's HBM3 bandwidth (datasheet): the denominator of ``% peak``."""
ENTRIES = ("dual", "groups", "blocks", "blocks_t")
OLD = "old"
LIBRARY = "library"
"""The one config of ``groups`` (its kernel is not chunked)."""
TINY = {"activations": [(200, 257), (136, 120)], "weights": [(136, 200)]}
"""``--tiny``: ragged shapes (not multiples of 128, edges inside a chunk)."""
FLUSH_BYTES = 256 << 20
"""Written before each timed call: evicts the input from L2 (50 MB on an H100)."""
DTYPE = E4M3
DEFAULTS = {"dual": DUAL_CONFIG, "blocks": BLOCKS_CONFIG, "blocks_t": BLOCKS_T_CONFIG}
"""The library's config of each chunked entry (its constant in ``quantize_triton``)."""
Quantised = list[tuple[torch.Tensor, torch.Tensor]]
"""``(data, scale)`` of each operand an entry makes."""


# The kernels before the chunked rewrite: the baseline the new configs are measured against.
@triton.jit
def _old_blocks_kernel(
    X, Q, S,
    R, C,
    stride_xr, stride_xc, stride_sr,
    FMAX: tl.constexpr, FLOOR: tl.constexpr, B: tl.constexpr,
    ROUND: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr, TRANS: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * B + tl.arange(0, B)
    cols = pid_c * B + tl.arange(0, B)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    r64 = rows.to(tl.int64)
    x = tl.load(
        X + r64[:, None] * stride_xr + cols[None, :].to(tl.int64) * stride_xc, mask=mask, other=0.0
    ).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.maximum(amax, FLOOR) / FMAX
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    if ROUND:
        q = _round_to_grid(q, MANT, MIN_EXP)
    if TRANS:
        c64 = cols.to(tl.int64)
        qt = tl.trans(q.to(Q.dtype.element_ty))
        tl.store(Q + c64[:, None] * R + r64[None, :], qt, mask=tl.trans(mask))
        tl.store(S + pid_c * stride_sr + pid_r, scale)
    else:
        tl.store(Q + r64[:, None] * C + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
        tl.store(S + pid_r * stride_sr + pid_c, scale)


@triton.jit
def _old_dual_kernel(
    X, Q, S, QT, ST,
    R, C,
    stride_xr, stride_xc, stride_sr, stride_sc, stride_str, stride_stc,
    FMAX: tl.constexpr, FLOOR: tl.constexpr, B: tl.constexpr,
    ROUND: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * B + tl.arange(0, B)
    cols = pid_c * B + tl.arange(0, B)
    rmask = rows < R
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_xr + c64[None, :] * stride_xc, mask=mask, other=0.0).to(
        tl.float32
    )
    ax = tl.abs(x)
    s_row = tl.maximum(tl.max(ax, axis=1), FLOOR) / FMAX
    q = tl.minimum(tl.maximum(x / s_row[:, None], -FMAX), FMAX)
    if ROUND:
        q = _round_to_grid(q, MANT, MIN_EXP)
    tl.store(Q + r64[:, None] * C + c64[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + r64 * stride_sr + pid_c * stride_sc, s_row, mask=rmask)
    s_col = tl.maximum(tl.max(ax, axis=0), FLOOR) / FMAX
    qc = tl.minimum(tl.maximum(x / s_col[None, :], -FMAX), FMAX)
    if ROUND:
        qc = _round_to_grid(qc, MANT, MIN_EXP)
    qt = tl.trans(qc.to(QT.dtype.element_ty))
    tl.store(QT + c64[:, None] * R + r64[None, :], qt, mask=tl.trans(mask))
    tl.store(ST + c64 * stride_str + pid_r * stride_stc, s_col, mask=cmask)


def _scales(rows: int, k: int, granularity: str, device: torch.device) -> torch.Tensor:
    """A scale tensor as the library allocates it (``fp8_quantize_eager``)."""
    make = torch.zeros if granularity == "128x128" else torch.empty
    storage = make(scale_storage_shape(rows, k, granularity), device=device, dtype=torch.float32)
    return scale_view(storage, granularity, k)


def _consts() -> dict[str, Any]:
    return {"FMAX": fp8_max(DTYPE), "FLOOR": AMAX_FLOOR, "B": 128, **_grid_args(DTYPE)}


def dual_fn(config: TileConfig | None) -> Callable[[torch.Tensor], Quantised]:
    """``dual`` with ``config`` (None: the old kernel), outputs allocated as the library does."""

    def run(x: torch.Tensor) -> Quantised:
        rows, cols = x.shape
        s, s_t = _scales(rows, cols, "1x128", x.device), _scales(cols, rows, "1x128", x.device)
        if config is not None:
            q, q_t = quantize_dual_triton(x, s, s_t, DTYPE, fp8_max(DTYPE), AMAX_FLOOR, config)
            return [(q, s), (q_t, s_t)]
        q = torch.empty(rows, cols, device=x.device, dtype=DTYPE)
        q_t = torch.empty(cols, rows, device=x.device, dtype=DTYPE)
        grid = (triton.cdiv(rows, 128), triton.cdiv(cols, 128))
        _old_dual_kernel[grid](
            x, q, s, q_t, s_t, rows, cols, x.stride(0), x.stride(1),
            s.stride(0), s.stride(1), s_t.stride(0), s_t.stride(1), num_warps=8, **_consts(),
        )  # fmt: skip
        return [(q, s), (q_t, s_t)]

    return run


def blocks_fn(config: TileConfig | None, trans: bool) -> Callable[[torch.Tensor], Quantised]:
    """``blocks`` (``trans``: ``blocks_t``) with ``config`` (None: the old kernel)."""

    def run(x: torch.Tensor) -> Quantised:
        rows, cols = x.shape
        out_rows, out_cols = (cols, rows) if trans else (rows, cols)
        s = _scales(out_rows, out_cols, "128x128", x.device)
        fmax = fp8_max(DTYPE)
        if config is not None and trans:
            q = quantize_blocks_transposed_triton(x, s, DTYPE, fmax, AMAX_FLOOR, config)
        elif config is not None:
            q = quantize_triton(x, s, "128x128", DTYPE, fmax, AMAX_FLOOR, config)
        else:
            q = torch.empty(out_rows, out_cols, device=x.device, dtype=DTYPE)
            grid = (triton.cdiv(rows, 128), triton.cdiv(cols, 128))
            _old_blocks_kernel[grid](
                x, q, s, rows, cols, x.stride(0), x.stride(1), s.stride(0), TRANS=trans,
                num_warps=8, **_consts(),
            )  # fmt: skip
        return [(q, s)]

    return run


def groups_fn(x: torch.Tensor) -> Quantised:
    """``groups``: the library's 1x128 kernel."""
    rows, cols = x.shape
    s = _scales(rows, cols, "1x128", x.device)
    return [(quantize_triton(x, s, "1x128", DTYPE, fp8_max(DTYPE), AMAX_FLOOR), s)]


def reference(entry: str, x: torch.Tensor) -> list[Fp8Operand]:
    """The torch reference's operands of ``entry`` for ``x``."""
    if entry == "dual":
        return [quantize_torch(x, "1x128", DTYPE), quantize_torch(x.t(), "1x128", DTYPE)]
    if entry == "groups":
        return [quantize_torch(x, "1x128", DTYPE)]
    if entry == "blocks":
        return [quantize_torch(x, "128x128", DTYPE)]
    return [quantize_torch(x.t(), "128x128", DTYPE)]


def moved_bytes(entry: str, rows: int, cols: int, in_bytes: int = 2) -> int:
    """What ``entry`` must move for an ``[rows, cols]`` input: one read of it, one write of
    each FP8 output (a byte a value) and of each fp32 scale."""
    rb, cb = math.ceil(rows / 128), math.ceil(cols / 128)
    if entry == "dual":
        return rows * cols * (in_bytes + 2) + 4 * (rows * cb + cols * rb)
    if entry == "groups":
        return rows * cols * (in_bytes + 1) + 4 * rows * cb
    return rows * cols * (in_bytes + 1) + 4 * rb * cb


def candidates(entry: str, names: set[str] | None) -> list[tuple[str, Callable, bool]]:
    """``(name, fn, is the library's default)`` of every implementation of ``entry``."""
    if entry == "groups":
        out = [(LIBRARY, groups_fn, True)]
    else:
        default = DEFAULTS[entry]
        make = dual_fn if entry == "dual" else (lambda c: blocks_fn(c, entry == "blocks_t"))
        out = [(c.name, make(c), c == default) for c in TILE_CONFIGS]
        out.append((OLD, make(None), False))
    return [c for c in out if names is None or c[0] in names or c[0] == LIBRARY]


def shapes_of(model: str) -> dict[str, dict[tuple[int, int], list[str]]]:
    """Per entry, each input shape and the operands of the layer that have it."""
    acts: dict[tuple[int, int], list[str]] = {}
    weights: dict[tuple[int, int], list[str]] = {}
    for linear, (m, n, k) in layer_linears(MODELS[model]).items():
        acts.setdefault((m, k), []).append(f"x {linear}")
        acts.setdefault((m, n), []).append(f"dy {linear}")
        weights.setdefault((n, k), []).append(f"W {linear}")
    acts, weights = dict(sorted(acts.items())), dict(sorted(weights.items()))
    return {e: weights if e.startswith("blocks") else acts for e in ENTRIES}


def tiny_shapes() -> dict[str, dict[tuple[int, int], list[str]]]:
    acts = {s: ["tiny"] for s in TINY["activations"]}
    weights = {s: ["tiny"] for s in TINY["weights"]}
    return {e: weights if e.startswith("blocks") else acts for e in ENTRIES}


def exact(got: Quantised, want: list[Fp8Operand]) -> bool:
    """Codes (as bytes) and scales equal the reference's."""
    return len(got) == len(want) and all(
        data.dtype == w.data.dtype
        and data.shape == w.data.shape
        and torch.equal(data.view(torch.uint8), w.data.view(torch.uint8))
        and torch.equal(scale, w.scale)
        for (data, scale), w in zip(got, want)
    )


def time_ms(fn: Callable, x: torch.Tensor, iters: int, warmup: int, flush: torch.Tensor) -> float:
    """Median ms of ``fn(x)``: accelerator events around each call, L2 flushed before it (the
    flush also keeps the device busy while the host launches the call)."""
    acc = get_accelerator()
    for _ in range(warmup):
        fn(x)
    events = []
    for _ in range(iters):
        flush.zero_()
        start, end = acc.event(enable_timing=True), acc.event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        events.append((start, end))
    acc.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def bench(shapes: dict[str, dict[tuple[int, int], list[str]]], names: set[str] | None,
          args: Any, device: torch.device, timed: bool) -> list[dict[str, Any]]:  # fmt: skip
    rows: list[dict[str, Any]] = []
    flush = torch.empty(FLUSH_BYTES if timed else 1, dtype=torch.int8, device=device)
    for entry in args.entries.split(","):
        for (r, c), operands in shapes[entry].items():
            gen = torch.Generator(device=device).manual_seed(r * 7 + c)
            row_scale = torch.exp2(
                torch.randint(-3, 3, (r, 1), device=device, generator=gen).float()
            )
            x = (torch.randn(r, c, device=device, generator=gen) * row_scale).bfloat16()
            want = reference(entry, x)
            nbytes = moved_bytes(entry, r, c, x.element_size())
            print(f"fp8_quant: {entry} {r} x {c}", file=sys.stderr, flush=True)
            for name, fn, default in candidates(entry, names):
                row = {"entry": entry, "shape": [r, c], "operands": operands, "impl": name,
                       "default": default, "bytes": nbytes}  # fmt: skip
                try:
                    row["exact"] = exact(fn(x), want)
                    ms = time_ms(fn, x, args.iters, args.warmup, flush) if timed else None
                except Exception as exc:  # a config this GPU / Triton refuses: recorded
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    rows.append(row)
                    continue
                row["ms"] = ms
                row["gb_s"] = nbytes / (ms * 1e-3) / 1e9 if ms else None
                row["peak_frac"] = nbytes / (ms * 1e-3) / HBM_BYTES_PER_S if ms else None
                rows.append(row)
            del x, want
    return rows


def winners(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per entry and shape: the fastest exact config, the library default's and old's times."""
    out = []
    keys = list(dict.fromkeys((r["entry"], tuple(r["shape"])) for r in rows))
    for entry, shape in keys:
        mine = [r for r in rows if r["entry"] == entry and tuple(r["shape"]) == shape]
        timed = [r for r in mine if r.get("exact") and r.get("ms")]
        if not timed:
            continue
        best = min(timed, key=lambda r: r["ms"])
        default = next((r for r in timed if r["default"]), None)
        old = next((r for r in mine if r["impl"] == OLD and r.get("ms")), None)
        out.append({"entry": entry, "shape": list(shape), "best": best["impl"], "ms": best["ms"],
                    "gb_s": best["gb_s"], "peak_frac": best["peak_frac"],
                    "default_ms": default["ms"] if default else None,
                    "old_ms": old["ms"] if old else None,
                    "speedup_vs_old": old["ms"] / best["ms"] if old else None})  # fmt: skip
    return out


def layer_totals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per entry and config: the time of one decoder layer's calls (each shape's time times
    the operands that have it), for configs exact and timed at every shape; the fastest
    first: the first of each entry is what its library config (``DEFAULTS``) should be."""
    out = []
    for entry in dict.fromkeys(r["entry"] for r in rows):
        mine = [r for r in rows if r["entry"] == entry]
        n_shapes = len({tuple(r["shape"]) for r in mine})
        totals = []
        for impl in dict.fromkeys(r["impl"] for r in mine):
            ok = [
                r
                for r in mine
                if r["impl"] == impl and r.get("ms") and (r.get("exact") or impl == OLD)
            ]
            if len(ok) == n_shapes:
                ms = sum(r["ms"] * len(r["operands"]) for r in ok)
                nbytes = sum(r["bytes"] * len(r["operands"]) for r in ok)
                totals.append({"entry": entry, "impl": impl, "layer_ms": ms,
                               "gb_s": nbytes / (ms * 1e-3) / 1e9, "default": ok[0]["default"]})  # fmt: skip
        totals.sort(key=lambda t: t["layer_ms"])
        old = next((t["layer_ms"] for t in totals if t["impl"] == OLD), None)
        for t in totals:
            t["speedup_vs_old"] = old / t["layer_ms"] if old else None
        out += totals
    return out


def render(rows: list[dict[str, Any]], wins: list[dict[str, Any]], totals: list[dict[str, Any]]) -> str:  # fmt: skip
    head = ["entry", "R x C", "operands", "impl", "us", "GB/s", "% of 3.35 TB/s", "exact"]
    body = []
    for r in rows:
        shape = " x ".join(map(str, r["shape"]))
        impl = r["impl"] + (" *" if r["default"] else "")
        if "error" in r:
            err = r["error"].splitlines()[0][:80].replace("|", "/")
            body.append([r["entry"], shape, ", ".join(r["operands"]), impl, f"failed: {err}",
                         "", "", ""])  # fmt: skip
            continue
        body.append([r["entry"], shape, ", ".join(r["operands"]), impl, fmt(r["ms"], ".1f", 1e3),
                     fmt(r["gb_s"], ".0f"), fmt(r["peak_frac"], ".1f", 100.0, "%"),
                     "yes" if r["exact"] else "NO"])  # fmt: skip
    table = md_table(head, body)
    if not wins:
        return table
    best = md_table(
        ["entry", "R x C", "best", "us", "GB/s", "% of 3.35 TB/s", "default us", "old us",
         "vs old"],
        [[w["entry"], " x ".join(map(str, w["shape"])), w["best"], fmt(w["ms"], ".1f", 1e3),
          fmt(w["gb_s"], ".0f"), fmt(w["peak_frac"], ".1f", 100.0, "%"),
          fmt(w["default_ms"], ".1f", 1e3), fmt(w["old_ms"], ".1f", 1e3),
          fmt(w["speedup_vs_old"], ".2f", suffix="x")] for w in wins],
    )  # fmt: skip
    per_layer = md_table(
        ["entry", "impl", "one layer's calls us", "GB/s", "vs old"],
        [[t["entry"], t["impl"] + (" *" if t["default"] else ""), fmt(t["layer_ms"], ".1f", 1e3),
          fmt(t["gb_s"], ".0f"), fmt(t["speedup_vs_old"], ".2f", suffix="x")] for t in totals],
    )  # fmt: skip
    return (
        f"{table}\n\nFastest exact config per entry and shape (`*`: the library's default):"
        f"\n\n{best}\n\nPer entry, one decoder layer's calls (each shape's time x the operands "
        f"that have it), fastest first:\n\n{per_layer}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3_1_7b", choices=sorted(MODELS))
    ap.add_argument("--entries", default=",".join(ENTRIES))
    ap.add_argument("--configs", default="", help="comma-separated config names (and 'old'); all if empty")  # fmt: skip
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="tiny ragged shapes, correctness only (CPU: TRITON_INTERPRET=1)")  # fmt: skip
    ap.add_argument("--out", type=Path)
    ap.add_argument("--results-dir", type=Path, default=env.REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    unknown = set(args.entries.split(",")) - set(ENTRIES)
    if unknown:
        ap.error(f"--entries {sorted(unknown)}: expected some of {list(ENTRIES)}")
    if args.iters < 1:
        ap.error("--iters must be >= 1")
    names = set(args.configs.split(",")) if args.configs else None
    known = {c.name for c in TILE_CONFIGS} | {OLD}
    if names is not None and names - known:
        ap.error(f"--configs {sorted(names - known)}: expected some of {sorted(known)}")
    acc = get_accelerator()
    device = acc.device()
    on_gpu = device.type == "cuda"
    if not on_gpu and not triton_interpreter_on():
        print("fp8_quant: no CUDA device; run with --tiny under TRITON_INTERPRET=1 on CPU")
        return 2
    if not args.tiny and not acc.supports_fp8:
        print(f"fp8_quant: {acc.device_name()} has no FP8; use --tiny on CPU")
        return 2
    shapes = tiny_shapes() if args.tiny else shapes_of(args.shapes)
    rows = bench(
        shapes, names, args, device, timed=on_gpu and not args.tiny and not triton_interpreter_on()
    )
    wins, totals = winners(rows), layer_totals(rows)
    table = render(rows, wins, totals)
    result = env.result_meta("fp8_quant", on_gpu, ["triton"], {k: str(v) for k, v in vars(args).items()})  # fmt: skip
    result["config"]["candidates"] = [c.name for c in TILE_CONFIGS] + [OLD]
    result["config"]["defaults"] = {e: c.name for e, c in DEFAULTS.items()}
    result["runs"], result["winners"], result["layer_totals"] = rows, wins, totals
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    note = (
        f"Library defaults: DUAL_CONFIG={DUAL_CONFIG.name}, BLOCKS_CONFIG={BLOCKS_CONFIG.name}, "
        f"BLOCKS_T_CONFIG={BLOCKS_T_CONFIG.name} "
        "(packages/kernels/src/longboat/kernels/fp8/quantize_triton.py)."
    )
    best: dict[str, str] = {}
    for t in totals:  # fastest first per entry
        if t["impl"] != OLD:
            best.setdefault(t["entry"], t["impl"])
    if best:
        note += " Fastest per layer: " + ", ".join(f"{e} {n}" for e, n in best.items()) + "."
    env.write_results(
        result, out=args.out, results_dir=None if args.tiny else args.results_dir,
        stem=f"fp8_quant_{env.DATE}", table=table, note=note,
    )  # fmt: skip
    print(table)
    print("\n" + note + f" {result['wall_s']:.0f} s (compiles included).")
    bad = [r for r in rows if not r.get("exact") and r["impl"] != OLD]
    for r in bad:
        print(f"fp8_quant: {r['entry']} {r['shape']} {r['impl']}: "
              f"{r.get('error', 'codes or scales differ from the reference')}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
