"""DP load balancing on a simulated VLM SFT mix: max / mean per-rank cost, before and after.

A global batch per step is drawn from a sample mix shaped like VLM SFT data (text only,
single images of 256-1344 px, several images, short videos), priced by a cost model of the
Qwen2.5-VL-3B shapes (decoder and ViT FLOPs per sample, attention quadratic in length),
and dealt to DP ranks twice: the plain sharding (rank r takes positions r, r + W, ...) and
``longboat.core.data.balance.balance`` under a pack-length cap of 1.2x the mean tokens per
rank. Nothing runs on a GPU: this measures the assignment, not a step time.

    uv run python tools/bench/dp_balance.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import numpy as np

from longboat.core.data.balance import CostModel, balance, round_robin

PIXELS_PER_TOKEN = 28  # Qwen2.5-VL: 14 px patches merged 2x2
# Qwen2.5-VL-3B, forward + backward FLOPs: 6 * params per token for the linears; causal
# attention 6 * d * layers per token pair (QK^T and AV, halved by the mask, x3 for bwd).
DECODER = CostModel(quadratic=6 * 2048 * 36, linear=6 * 3.1e9, per_item=0.0)
# The ViT (32 layers, hidden 1280, 0.67B): full attention in 4 layers over an image's
# patches, windows of 64 patches in the other 28.
VIT = CostModel(quadratic=12 * 1280 * 4, linear=6 * 0.67e9 + 12 * 1280 * 28 * 64, per_item=0.0)


def _image_tokens(rng: np.random.Generator, lo: int, hi: int) -> int:
    h, w = rng.integers(lo, hi + 1, size=2)
    return int(np.ceil(h / PIXELS_PER_TOKEN) * np.ceil(w / PIXELS_PER_TOKEN))


def draw_samples(rng: np.random.Generator, n: int) -> list[dict[str, object]]:
    """``n`` samples: text tokens plus the merged-token counts of their images / videos."""
    out = []
    for kind in rng.choice(["text", "image", "multi", "video"], size=n, p=[0.3, 0.45, 0.15, 0.1]):
        text = int(np.clip(rng.lognormal(np.log(250), 0.9), 16, 6000))
        vision: list[int] = []
        if kind == "image":
            vision = [_image_tokens(rng, 256, 1344)]
        elif kind == "multi":
            vision = [_image_tokens(rng, 256, 768) for _ in range(rng.integers(2, 7))]
        elif kind == "video":
            frames = int(rng.integers(8, 33))
            vision = [(frames // 2) * _image_tokens(rng, 336, 448)]
        out.append({"kind": str(kind), "text": text, "vision": vision})
    return out


def sample_cost(sample: dict[str, object]) -> tuple[float, int]:
    """(FLOPs of one sample through ViT + decoder, its decoder tokens)."""
    vision = list(sample["vision"])  # type: ignore[arg-type]
    tokens = int(sample["text"]) + sum(vision)  # type: ignore[arg-type]
    patches = [4 * v for v in vision]  # 2x2 patches per merged token
    return DECODER.cost([tokens]) + VIT.cost(patches), tokens


def simulate(dp: int, per_rank: int, steps: int, seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    before, after, capped = [], [], []
    for _ in range(steps):
        batch = draw_samples(rng, dp * per_rank)
        priced = [sample_cost(s) for s in batch]
        costs = np.array([c for c, _ in priced])
        tokens = np.array([t for _, t in priced], dtype=np.float64)
        cap = 1.2 * tokens.sum() / dp
        got = balance(costs, dp, sizes=tokens, size_cap=cap)
        before.append(round_robin(costs, dp).imbalance)
        after.append(got.imbalance)
        capped.append(max(tokens[list(r)].sum() for r in got.ranks) / (tokens.sum() / dp))
    return {
        "dp": dp,
        "samples_per_rank": per_rank,
        "steps": steps,
        "before_mean": float(np.mean(before)),
        "before_p95": float(np.percentile(before, 95)),
        "after_mean": float(np.mean(after)),
        "after_p95": float(np.percentile(after, 95)),
        "max_tokens_over_mean": float(np.max(capped)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--per-rank", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON + table")
    args = parser.parse_args()
    rows = [simulate(dp, args.per_rank, args.steps, args.seed) for dp in (8, 64)]
    mix = draw_samples(np.random.default_rng(args.seed), 20_000)
    tokens = np.array([sample_cost(s)[1] for s in mix])
    lines = [
        "| DP | samples / rank | max/mean cost, plain sharding (mean, p95) "
        "| balanced (mean, p95) | max tokens / mean after |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dp']} | {r['samples_per_rank']} | {r['before_mean']:.3f}, "
            f"{r['before_p95']:.3f} | {r['after_mean']:.3f}, {r['after_p95']:.3f} "
            f"| {r['max_tokens_over_mean']:.2f} |"
        )
    summary = (
        f"Sample mix: {len(mix):,} draws, decoder tokens median {int(np.median(tokens))}, "
        f"p99 {int(np.percentile(tokens, 99))}, max {int(tokens.max())} "
        f"(ratio max/min {tokens.max() / tokens.min():.0f}x); {args.steps} steps per row, "
        "pack-length cap 1.2x the mean tokens per rank."
    )
    table = "\n".join(lines)
    print(summary + "\n\n" + table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"dp_balance_{dt.date.today().isoformat()}"
        stem.with_suffix(".json").write_text(
            json.dumps({"rows": rows, "summary": summary, "seed": args.seed}, indent=2) + "\n"
        )
        stem.with_suffix(".md").write_text(
            "# DP load balancing on a simulated VLM SFT mix\n\n"
            "`uv run python tools/bench/dp_balance.py --out benchmarks/results` (CPU, no "
            "GPU: the cost is the Qwen2.5-VL-3B FLOP model of each sample, not a measured "
            "step time).\n\n" + summary + "\n\n" + table + "\n"
        )


if __name__ == "__main__":
    main()
