"""VLM SFT throughput: Hugging Face vs ``longboat-vlm train``, one process, one of two shapes.

    python tools/bench/vlm_throughput.py --out results.json [--shape qwen2_5_vl_3b|qwen3_vl_moe]
        [--tiny] [--steps N] [--warmup N] [--runs hf,hf_compiled,hf_liger,longboat,...]
        [--results-dir DIR] [--time-budget S] [--profile-steps N --profile-dir DIR]

``--shape qwen2_5_vl_3b`` (the default): Qwen2.5-VL-3B (``model=qwen2_5_vl_3b``: ViT 32 layers
x 1280 with window attention and 4 full-attention layers, merger to 2048; Qwen2.5-3B decoder,
36 layers, 16 / 2 heads, vocab 151,936, tied), random init. Data: ``--samples`` generated
conversations, each four images of mixed sizes (644x644, 448x896, 812x588, 336x504 px: 1,866
image tokens) and an assistant answer that fills the sample to about 8,100 tokens, so each
sample is one packed row of ``seq_len`` 8192.

``--shape qwen3_vl_moe``: Qwen3-VL-30B-A3B cut to fit one 80 GB GPU (``QWEN3_VL_MOE``: the
real 27-block tower, the decoder cut to 4 of its 48 layers at the real width), seq 4096,
three images a sample, against transformers' ``Qwen3VLMoeForConditionalGeneration`` (its
``grouped_mm`` experts, the load-balancing term in the loss); the memory estimate of both
sides is in ``QWEN3_VL_MOE``'s docstring::

    python tools/bench/vlm_throughput.py --shape qwen3_vl_moe --runs hf,longboat \\
        --steps 10 --warmup 3 --out results.json --results-dir DIR

Every run sees the same samples (``--tiny``: the shape's CPU-sized model, the smoke test).

Runs:
- ``longboat``: ``longboat-vlm train experiment=sft`` with the benchmark's model, data,
  seq_len and global batch 1 (``overrides``), everything else the CLI's defaults:
  ``build_training`` run by core's ``Trainer``. ``longboat_<variant>``: plus the keys of
  ``VARIANTS``.
- ``hf`` / ``hf_compiled`` / ``hf_liger``: ``baselines/vlm_reference.py`` (its docstring lists
  how it differs from an HF Trainer run) on the same rows, one sample per step; ``hf_liger``
  (Qwen2.5-VL's Liger patches) has no counterpart for the MoE shape (a skipped row).

Per run: median step time (steps back to back, device events between steps), tokens/s counting
the samples' real tokens (not the row padding), MFU (the family's ``flops_per_sample``: decoder
6 N per token, N the matrices a token passes through (an MoE layer's router and top-k experts),
+ LM head + causal attention; ViT 6 N per patch + attention + mergers), peak memory.
Writes ``--out`` and ``<results-dir>/vlm_throughput_<date>.{json,md,png}`` (``_qwen3_vl_moe``
in the name for that shape); prints the table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_env as env
import numpy as np
import torch
from baselines import vlm_reference as ref
from bench_env import failed_row, fmt, md_table
from bench_profile import profile_steps
from bench_timing import time_loop
from bench_train import compose, train_timed

EXPERIMENT = "sft"
FULL = dict(family="qwen2_5_vl", model="qwen2_5_vl_3b", seq=8192, images=((644, 644), (448, 896),
            (812, 588), (336, 504)), px=28, vocab=4096, samples=12)  # fmt: skip
TINY = dict(family="qwen2_5_vl", model="qwen2_5_vl_tiny", seq=512, images=((56, 56), (84, 56)),
            px=8, vocab=380, samples=4)  # fmt: skip
QWEN3_VL_MOE = dict(family="qwen3_vl_moe", model="qwen3_vl_moe_30b_a3b", layers=4, seq=4096,
                    images=((640, 640), (448, 896), (320, 512)), px=32, vocab=4096,
                    samples=12)  # fmt: skip
"""Qwen3-VL-30B-A3B cut to fit one 80 GB H100 with AdamW on both sides: the released tower
(27 blocks x 1152, patch 16, merges of 2x2, deepstack mergers after blocks 8 / 16 / 24) and
the decoder at its real width (hidden 2048, 32 / 4 heads of 128, qk-norm, 128 experts top-8
of SwiGLU 768, untied vocab 151,936, load-balancing weight 0.001) cut to 4 of its 48 layers
(the deepstack features go into layers 0-2); seq 4096, micro-batch 1: three images a sample
(640x640, 448x896, 320x512 px: 952 image tokens, 3,808 patches) and an answer filling the row.

Parameters: 3.653 B (decoder layers 4 x 623.1 M, of which the experts 604.0 M; embedding and
LM head 2 x 311.2 M; the tower with its four mergers 0.539 B); a token passes through 0.539 B
of the decoder's matrices and LM head (4 x 56.9 M + 311.2 M, ``qwen3_vl.flops``).

Memory (GiB = 2^30 bytes; an H100 80 GB holds 79.1 GiB):
- longboat (bf16 weights, fp32 grad buffer, fp32 main weights and AdamW moments: 18 bytes a
  parameter): states 61.2, activations 8.8, backward workspace 1.2, allowance 0.5: 71.7 with
  no recompute (core's ``estimate_stage_peak`` over ``DecoderShapes`` and
  ``qwen3_tower_shapes``, the estimate that gives 50.3 for the LLM benchmark's Qwen3-MoE
  4-layer cut, measured 50.6). 5 layers: 82.7 (76.1 with full recompute), over the device.
- HF (fp32 weights under bf16 autocast, fp32 grads, AdamW's two fp32 moments: 16 bytes a
  parameter, 54.4): in the forward (grads freed after each step) weights and moments 40.8,
  autocast's bf16 copies of the 0.92 B non-expert matrices 1.7, and what the forward saves,
  as counted on CPU with ``saved_tensors_hooks`` at this width: 325 kB a token a decoder
  layer (fp32 residual and norms, bf16 attention inputs, the grouped experts' fp32 rows, 8 a
  token) = 4.9, the fp32 log-softmax of the loss = 2.3, 40 kB a patch a tower block = 3.9:
  about 54 at the loss. The loss's backward adds about 6 (fp32 and bf16 logits grads, the LM
  head's weight grad) and the rest of the backward frees more activations than it adds
  grads: a peak of about 60 (the same count gives 48.9 for the LLM benchmark's Qwen3-MoE
  cut, measured 47.6). 5 layers: about 68. Margin at 4 layers: 7.4 GiB for longboat.
"""
QWEN3_VL_MOE_TINY = dict(family="qwen3_vl_moe", model="qwen3_vl_moe_tiny", layers=2, seq=512,
                         images=((56, 56), (84, 56)), px=8, vocab=300, samples=4)  # fmt: skip
SHAPES = {"qwen2_5_vl_3b": FULL, "qwen3_vl_moe": QWEN3_VL_MOE}
TINY_SHAPES = {"qwen2_5_vl_3b": TINY, "qwen3_vl_moe": QWEN3_VL_MOE_TINY}
VARIANTS: dict[str, list[str]] = {"longboat": [], "longboat_no_balance": ["vlm.dp_balance=false"]}
"""Config keys each longboat run adds to the CLI's defaults."""
ALL_RUNS = ("hf", "hf_compiled", "hf_liger", "longboat")
MOE_RUNS = ("hf", "longboat")
"""The MoE shape's default runs (``hf_compiled`` on request: under ``torch.compile``
transformers runs fp32 experts as a per-expert loop)."""
MOE_SKIPS = {"hf_liger": "Liger's Qwen2.5-VL patches have no Qwen3-VL-MoE counterpart here"}
PEERS = ("transformers", "triton", "megatron-core", "liger-kernel")
RUN_WEIGHT = {"hf_compiled": 2.0}


def make_data(out: Path, c: dict[str, Any], seed: int) -> tuple[Path, Path]:
    """Images, a JSONL of conversations and a tokenizer under ``out``; returns (jsonl, tokenizer)."""
    from PIL import Image

    from longboat.vlm.data.tiny_tokenizer import build_vlm_tokenizer

    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(3000)]

    def prose(n: int) -> str:
        return " ".join(rng.choice(words, size=n))

    tok_info = build_vlm_tokenizer(
        [prose(4000) for _ in range(4)], out / "tok", vocab_size=c["vocab"]
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_info.path))
    px = c["px"]  # pixels per merged token side (patch x merge)
    image_tokens = sum(-(-h // px) * -(-w // px) for w, h in c["images"])
    budget = c["seq"] - image_tokens - 96  # chat markup, question, vision start / end tokens
    rows = []
    for s in range(c["samples"]):
        names = []
        for k, (w, h) in enumerate(c["images"]):
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            name = f"s{s}_{k}.png"
            Image.fromarray(pixels).save(out / name)
            names.append(name)
        answer = tok.decode(tok(prose(2 * budget))["input_ids"][:budget])
        question = "".join("<image>\n" for _ in names) + "Describe the images."
        rows.append({"image": names, "conversations": [
            {"from": "human", "value": question}, {"from": "gpt", "value": answer}]})  # fmt: skip
    path = out / "conversations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, tok_info.path


def overrides(c: dict[str, Any], data: Path, tok: Path) -> list[str]:
    """The benchmark's model (a cut shape: its decoder depth), data and batch on top of
    ``experiment=sft``."""
    depth = [f"model.language.num_layers={c['layers']}"] if "layers" in c else []
    return [f"model={c['model']}", *depth, f"data.paths=[{data}]", f"data.tokenizer={tok}",
            f"data.seq_len={c['seq']}", "data.eval_fraction=0.0", "train.global_batch_size=1",
            "train.eval_every=0", "vlm.answer_eval_samples=0"]  # fmt: skip


def flops_per_sample(
    model_cfg: Any, tokens: int, grids: list[list[int]], family: str = "qwen2_5_vl"
) -> float:
    """Training FLOPs of one sample, as the model's family counts them
    (``Family.flops_per_sample``; an MoE decoder: its active parameters)."""
    from longboat.core.family import find_family

    return find_family("vlm", family).flops_per_sample(model_cfg, tokens, grids)


def measure_rows(cfg: Any) -> tuple[Any, list[dict], float, float]:
    """The run's model config (with the tokenizer's token ids), its packed rows, and a row's
    mean real tokens and training FLOPs (as ``model.name``'s family counts them)."""
    from longboat.vlm.train.data import open_run_data
    from longboat.vlm.train.training import model_config

    run_data = open_run_data(cfg, model_config(cfg), progress=False)
    rows = [run_data.train[i] for i in range(len(run_data.train))]
    lengths = [int(r["cu_seqlens"][1]) for r in rows]
    flops = float(np.mean([flops_per_sample(run_data.model_cfg, n, r["image_grid_thw"].tolist(),
                                            cfg.model.name)
                           for n, r in zip(lengths, rows, strict=True)]))  # fmt: skip
    return run_data.model_cfg, rows, float(np.mean(lengths)), flops


def run_longboat(name: str, c: dict[str, Any], base: list[str], acc: Any, args: Any) -> dict:
    def probe(training: Any) -> dict[str, Any]:
        return {"precision": training.precision, "describe": training.describe()}

    out = args.profile_dir and args.profile_dir / f"vlm_profile_{name}.txt"
    return train_timed("vlm", EXPERIMENT, [*base, *VARIANTS[name]], acc, warmup=args.warmup,
                       steps=args.steps, profile_steps=args.profile_steps, profile_out=out,
                       probe=probe)  # fmt: skip


def run_baseline(
    name: str, family: str, model_cfg: Any, optim: Any, rows: list[dict], acc: Any, args: Any
) -> dict[str, Any]:
    device = acc.device()
    leftover = env.free_memory(acc)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    if family == "qwen3_vl_moe":
        model = ref.hf_qwen3_vl_moe(model_cfg, device)
    else:
        model = ref.hf_qwen2_5_vl(model_cfg, device, liger=name == "hf_liger")
    compiled = name == "hf_compiled"
    step = ref.HFVLMStep(model, optim, device, compiled=compiled)
    build_s = time.perf_counter() - t0
    m = model_cfg
    batches = [ref.hf_batch(r, m.image_token_id, m.video_token_id) for r in rows]
    cycle = (batches[i % len(batches)] for i in range(10**9))
    timing, losses = time_loop(acc, cycle, lambda b, i: step(b), args.warmup, args.steps)
    notes: dict[str, Any] = {"forward": step.forward_module}
    experts = ref.hf_experts_kernel(model, compiled=compiled)
    if experts:
        notes["experts"] = experts
    out = args.profile_dir and args.profile_dir / f"vlm_profile_{name}.txt"
    summary = profile_steps(acc, lambda i: step(batches[i % len(batches)]), args.profile_steps, out)
    if summary:
        notes["profile"] = summary
    peak = acc.memory_stats().get("peak_allocated_gb", 0.0)
    return {"timing": timing, "losses": losses, "peak_mem_gb": peak, "build_s": build_s,
            "items_per_step": 1, "allocated_at_start_gb": leftover, "notes": notes}  # fmt: skip


def entry(name: str, r: dict[str, Any], tokens: float, flops: float) -> dict[str, Any]:
    """Per-step rates from the median step: ``tokens`` / ``flops`` are a sample's means."""
    s = r.pop("timing").summary(1)
    step_s = s["median_step_s"]
    return {"name": name, "tokens_per_s": tokens / step_s, "mfu": flops / step_s / env.PEAK_BF16_FLOPS,
            "peak_mem_gb": r.pop("peak_mem_gb"), **s, **r}  # fmt: skip


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    ok = [r for r in runs if "tokens_per_s" in r and r["name"].startswith("hf")]
    base = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
    mfu = "MFU (active params)" if result["config"]["family"] == "qwen3_vl_moe" else "MFU"
    header = ["run", "tokens/s", f"vs {base['name'] if base else 'hf'}", mfu, "peak mem (GB)",
              "median step (s)", "last loss"]  # fmt: skip
    rows = []
    for r in runs:
        if "tokens_per_s" not in r:
            rows.append(failed_row(r, len(header)))
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        rows.append([r["name"], fmt(r["tokens_per_s"], ".2f", 1e-3, "k"), ratio,
                     fmt(r["mfu"], ".1%"), fmt(r["peak_mem_gb"], ".1f"),
                     fmt(r["median_step_s"]), fmt(r["losses"][-1])])  # fmt: skip
    return md_table(header, rows)


def plot(result: dict[str, Any]) -> Any:
    runs = [r for r in result["runs"] if "tokens_per_s" in r]
    title = f"vlm_throughput {result['date']} {result['gpu']}: {result['config']['model']}"
    return lambda plt: runs and env.bar_chart(
        plt, title, [r["name"] for r in runs],
        [([r["tokens_per_s"] / 1e3 for r in runs], "tokens/s (thousands)"),
         ([r["peak_mem_gb"] for r in runs], "peak memory (GB)")],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen2_5_vl_3b",
        help="the model shape (module doc)",
    )
    p.add_argument("--tiny", action="store_true", help="the shape's tiny model (CPU smoke)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--samples", type=int, default=0, help="generated samples (0: the shape's)")
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="decoder layers of a cut shape (qwen3_vl_moe; 0: the shape's)",
    )
    p.add_argument("--runs", default=None, help=f"comma list out of {','.join(ALL_RUNS)}")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--time-budget", type=float, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-steps", type=int, default=0)
    p.add_argument("--profile-dir", type=Path, default=None)
    args = p.parse_args(argv)
    import importlib.util

    from longboat.core.device import get_accelerator

    acc = get_accelerator()
    on_gpu = acc.device_type != "cpu"
    c = dict((TINY_SHAPES if args.tiny else SHAPES)[args.shape])
    c["samples"] = args.samples or c["samples"]
    if args.layers:
        if "layers" not in c:
            p.error(
                f"--layers: the {args.shape} shape is not a cut shape; it keeps its flavor's depth"
            )
        c["layers"] = args.layers
    moe = c["family"] == "qwen3_vl_moe"
    default = (MOE_RUNS if moe else ALL_RUNS) if on_gpu else ("hf", "longboat")
    if importlib.util.find_spec("liger_kernel") is None:
        default = tuple(r for r in default if r != "hf_liger")
    runs = args.runs.split(",") if args.runs else list(default)
    unknown = [r for r in runs if r not in ALL_RUNS and r not in VARIANTS]
    if unknown:
        p.error(f"--runs: unknown {unknown}; pick from {[*ALL_RUNS, *VARIANTS]}")
    skipped = {r: MOE_SKIPS[r] for r in runs if moe and r in MOE_SKIPS}
    runs = [r for r in runs if r not in skipped]
    # Liger patches transformers' Qwen2.5-VL modules for the rest of the process (a later
    # hf_compiled would trace Liger's kernels): it runs last.
    runs.sort(key=lambda r: r == "hf_liger")
    with tempfile.TemporaryDirectory(prefix="vlm_bench_") as tmp:
        data, tok = make_data(Path(tmp), c, args.seed)
        base = overrides(c, data, tok)
        cfg = compose("vlm", EXPERIMENT, base, str(Path(tmp) / "run"))
        model_cfg, rows, tokens, flops = measure_rows(cfg)
        config = {"shape": args.shape, **{k: v for k, v in c.items() if k not in ("images", "px")},
                  "images": [list(x) for x in c["images"]],
                  "rows": len(rows), "mean_tokens": tokens, "flops_per_sample": flops,
                  "overrides": [o for o in base if not o.startswith(("data.paths", "data.tok"))],
                  "steps": args.steps, "warmup": args.warmup, "variants": VARIANTS}  # fmt: skip
        result = env.result_meta("vlm_throughput", on_gpu, PEERS, config)
        for name, why in skipped.items():  # asked for, but no counterpart for this shape
            print(f"== {name}: skipped ({why})", flush=True)
            result["runs"].append({"name": name, "error": f"skipped: {why}"})

        def run_one(name: str) -> dict[str, Any]:
            if name in VARIANTS:
                return entry(name, run_longboat(name, c, base, acc, args), tokens, flops)
            return entry(
                name,
                run_baseline(name, c["family"], model_cfg, cfg.optim, rows, acc, args),
                tokens,
                flops,
            )

        stem = "" if args.shape == "qwen2_5_vl_3b" else f"{args.shape}_"

        def write() -> None:
            env.write_results(result, out=args.out, results_dir=args.results_dir,
                              stem=f"vlm_throughput_{stem}{result['date']}", table=table(result),
                              plot=plot(result), note=f"config: {json.dumps(config)}")  # fmt: skip

        env.run_all(runs, run_one, result, write, time_budget=args.time_budget, weights=RUN_WEIGHT,
                    describe=lambda r: f"{r['tokens_per_s']:.0f} tokens/s, "
                    f"peak {r['peak_mem_gb']:.1f} GB, build {r['build_s']:.1f}s")  # fmt: skip
    write()
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
