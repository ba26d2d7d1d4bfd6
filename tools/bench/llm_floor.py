"""The floor under one LLM training step: its GEMMs and attention timed alone.

    python tools/bench/llm_floor.py [--out floor.json]

For the llm_throughput model (hidden 2048, 16 layers, 16 / 8 heads, head_dim 128, SwiGLU
5632, vocab 32000, seq 2048, micro-batch 8 = 16384 tokens) every matmul of a training step
(forward, input-grad and weight-grad GEMMs of each linear layer and the output layer) is run
alone in bf16 and timed with CUDA events, and so is causal GQA attention forward + backward
through each SDPA backend. The sum is the time a step cannot go under with these kernels;
the gap between it and the measured step is what fusion, overlap and launch work can win.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

H, L, NH, KVH, D, FFN, V, S, B = 2048, 16, 16, 8, 128, 5632, 32000, 2048, 8
T = S * B


def bench(fn, iters: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median milliseconds of ``fn()`` over ``iters`` runs after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def linear_ms(tokens: int, k: int, n: int) -> dict[str, float]:
    """y[T, n] = x[T, k] @ W[n, k]^T: forward, dgrad and wgrad GEMMs."""
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(tokens, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt)
    g = torch.randn(tokens, n, device=dev, dtype=dt)
    fwd = bench(lambda: x @ w.t())
    dgrad = bench(lambda: g @ w)
    wgrad = bench(lambda: g.t() @ x)
    flop = 2 * tokens * k * n
    return {
        "fwd_ms": fwd,
        "dgrad_ms": dgrad,
        "wgrad_ms": wgrad,
        "tflops_fwd": flop / fwd / 1e9,
        "tflops_dgrad": flop / dgrad / 1e9,
        "tflops_wgrad": flop / wgrad / 1e9,
    }


def attention_ms() -> dict[str, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, NH, S, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, KVH, S, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, KVH, S, D, device=dev, dtype=dt, requires_grad=True)
    out: dict[str, float] = {}
    for name, backend, gqa in (
        ("flash_gqa", SDPBackend.FLASH_ATTENTION, True),
        ("cudnn_gqa", SDPBackend.CUDNN_ATTENTION, True),
        ("cudnn_expanded", SDPBackend.CUDNN_ATTENTION, False),
        ("flash_expanded", SDPBackend.FLASH_ATTENTION, False),
    ):

        def run(backend=backend, gqa=gqa) -> None:  # type: ignore[no-untyped-def]
            kk, vv = (k, v) if gqa else (k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
            o.backward(torch.ones_like(o))

        try:
            out[name + "_fwd_bwd_ms"] = bench(run, iters=10)
        except Exception as exc:
            out[name + "_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    shapes = {
        "qkv": (H, (NH + 2 * KVH) * D),
        "proj": (NH * D, H),
        "fc1": (H, 2 * FFN),
        "fc2": (FFN, H),
        "output": (H, V),
    }
    gemm = {name: linear_ms(T, k, n) for name, (k, n) in shapes.items()}
    per_layer = sum(
        g["fwd_ms"] + g["dgrad_ms"] + g["wgrad_ms"] for n, g in gemm.items() if n != "output"
    )
    # The output layer has no dgrad into the embedding; its dgrad feeds the final norm.
    out_layer = sum(gemm["output"][k] for k in ("fwd_ms", "dgrad_ms", "wgrad_ms"))
    att = attention_ms()
    best_att = min(v for k, v in att.items() if k.endswith("_ms"))
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gemm": gemm,
        "gemm_ms_per_step": L * per_layer + out_layer,
        "attention": att,
        "attention_ms_per_step_best": L * best_att,
    }
    result["floor_ms_per_step"] = result["gemm_ms_per_step"] + result["attention_ms_per_step_best"]
    result["floor_tokens_per_s"] = T / (result["floor_ms_per_step"] / 1e3)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
