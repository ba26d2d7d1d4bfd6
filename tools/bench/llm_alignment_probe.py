"""A CPU-sized loss-alignment probe: HF vs longboat's product step on a mid-size Llama.

    python tools/bench/llm_alignment_probe.py [--steps 16] [--warmup-steps 20]
        [--precision bf16|fp32] [--bf16-init] [--longboat-option KEY=JSON ...]

The same comparison as ``llm_loss_alignment.py`` (HF weights saved and loaded into
longboat, the same byte-level text batches, AdamW with LR warm-up and clipping in both
loops), at hidden 512, 8 layers, vocab 32000, seq 256, micro-batch 2: ~35 s on 2 CPU cores.
It isolates precision effects without a GPU; prints the per-step loss differences.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llm_loss_alignment as la
import llm_throughput as lt
from bench_env import key_values

from longboat.core.device import get_accelerator

MID = dict(
    vocab=32000, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, ffn=1408, seq=256,
    micro_batch=2,
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--bf16-init", action="store_true", help="round the HF init to bf16 first")
    p.add_argument("--longboat-option", action="append", default=[], metavar="KEY=JSON")
    args = p.parse_args(argv)
    options = key_values(args.longboat_option, "--longboat-option")
    batches = la.text_batches(args.steps, MID["micro_batch"], MID["seq"])
    acc = get_accelerator()
    device = acc.device()
    torch.manual_seed(0)
    import longboat.llm.train.train_step as train_step_module

    build = train_step_module.build_train_step

    def with_precision(*a, **k):  # type: ignore[no-untyped-def]
        k["precision"] = args.precision
        return build(*a, **k)

    train_step_module.build_train_step = with_precision
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hf = lt.hf_model(MID, device)
            for m in hf.modules():
                if hasattr(m, "variance_epsilon"):
                    m.variance_epsilon = 1e-5
            hf.config.rms_norm_eps = 1e-5
            if args.bf16_init:
                with torch.no_grad():
                    for param in hf.parameters():
                        param.copy_(param.to(torch.bfloat16).float())
            hf.save_pretrained(tmp)
            h = la.hf_losses(hf, batches, device, args.lr, args.warmup_steps, 1.0)
            lb, _ = la.longboat_losses(
                Path(tmp), batches, acc, args.lr, args.warmup_steps, 1.0, options
            )
    finally:
        train_step_module.build_train_step = build
        lt.teardown_megatron()
    diffs = [b - a for a, b in zip(h, lb)]
    print(json.dumps({"precision": args.precision, "bf16_init": args.bf16_init,
                      "warmup_steps": args.warmup_steps, "options": options}))  # fmt: skip
    print("dloss per step (longboat - hf):", [round(d, 4) for d in diffs])
    print(f"max |dloss| {max(map(abs, diffs)):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
