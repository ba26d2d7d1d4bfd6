"""LLM loss alignment: HF transformers vs longboat from the same weights on the same batches.

    python tools/bench/llm_loss_alignment.py --out results.json [--tiny] [--steps 200]
        [--micro-batch 4] [--seq 2048] [--results-dir DIR] [--override KEY=VALUE ...]

A seeded fp32 ``transformers`` model of llm_throughput's shape (``--shape``: ``LlamaForCausalLM``
for the 886M shape, ``Qwen3ForCausalLM`` for ``qwen3_1_7b``, ``Qwen3MoeForCausalLM`` for
``qwen3_moe_4l``, ``DeepseekV3ForCausalLM`` for ``moonlight_4l``) is saved with
``save_pretrained``; longboat starts from it (``model.init_from``), the reference loads it
again. For the Qwen3-MoE shape both sides train with the load-balancing term in the objective
and the curves are the LM losses; for the DeepSeek-V3 shape both train without one and with a
fixed routing bias, as transformers' model does (``routing_overrides``).

- ``longboat``: ``longboat-llm train experiment=quickstart`` with llm_throughput's shape and
  batch, ``--steps`` steps, its own data (``data=quickstart``: the shipped text under a BPE of at
  most 1024 ids, packed rows of ``--seq`` tokens; ``data.document_attention=false``: plain causal
  attention on both sides), the CLI's defaults for the rest (optimizer, LR schedule, clipping,
  precision) plus any ``--override``: ``build_training`` + ``Trainer``.
- ``reference``: ``hf_eager`` (``llm_reference.HFStep``: fp32 weights + bf16 autocast where
  longboat trains in bf16, AdamW with the config's settings, LR schedule and clipping) on the very
  batches of the built run (``training.batches(0)``), its loss over the same targets
  (``shift_labels`` = longboat's labels where its loss mask keeps them).
- ``reference_perturbed``: the reference with every batch's rows reversed: the noise band
  (``bench_align``).
- ``candidate`` (with ``--candidate KEY=VALUE ...``, e.g. ``train.precision=fp8``): longboat
  again from the same weights on the same batches with those keys, judged against the
  ``longboat`` run within the same band (``candidate_verdict``; e.g. FP8 against our bf16),
  and also that its mean signed difference over the last 100 steps is inside
  ``+-CANDIDATE_BIAS``.

Writes ``max_abs_loss_diff``, the verdict and the curves to ``--out`` and
``<results-dir>/llm_loss_alignment_<date>.{json,md,png}``; prints the table last.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import bench_align
import llm_throughput as lt
import torch
from baselines import llm_reference as ref
from bench_env import free_memory, key_values, md_table, result_meta, write_results
from bench_train import compose, train_timed

CACHE = Path(os.environ.get("TMPDIR", "/tmp")) / "longboat_bench_quickstart"
"""Where the quickstart corpus is built once (``data.out_dir``)."""


CANDIDATE_BIAS = 0.01
"""Largest mean signed loss difference over the tail a candidate may show against longboat."""


def hydra_keys(items: list[str], flag: str) -> list[str]:
    """``KEY=VALUE`` items as the command line gave them (``model.q_lora_rank=null`` stays
    ``null``), checked by ``key_values``; a later item of the same key wins."""
    key_values(items, flag)
    return list({item.partition("=")[0]: item for item in items}.values())


def data_overrides(c: dict[str, int], cache: Path) -> list[str]:
    return [f"data.seq_len={c['seq']}", "data.document_attention=false",
            f"data.vocab_size={min(1024, c['vocab'])}", f"data.out_dir={cache}"]  # fmt: skip


def routing_overrides(c: dict[str, Any]) -> list[str]:
    """DeepSeek-V3 shapes: transformers' ``DeepseekV3ForCausalLM`` trains with a fixed routing
    bias and no balance loss, so longboat runs with the aux-loss-free bias update and the
    sequence-wise loss off for the comparison (both are on in its defaults)."""
    if c.get("family") != "deepseek_v3":
        return []
    return ["model.moe_router_bias_update_rate=0", "model.moe_aux_loss_coeff=0"]


def shape(
    tiny: bool, micro_batch: int | None = None, seq: int | None = None, name: str = "886m"
) -> dict[str, int]:
    """llm_throughput's shape ``name`` at micro-batch 4 (tiny: 2, and 512 ids: room for the
    byte-level BPE's 256 + special ids)."""
    base = lt.TINY_SHAPES[name] if tiny else lt.SHAPES[name]
    c = dict(base, micro_batch=micro_batch or (2 if tiny else 4))
    if tiny:
        c["vocab"] = 512
        if "flavor" in c:  # a flavor keeps its own vocabulary unless a key sets it
            c["keys"] = [*c.get("keys", []), "model.vocab_size=512"]
    return {**c, "seq": seq or c["seq"]}


def reference_losses(
    hf_dir: Path, batches: list[list[dict]], cfg: Any, acc: Any, *, bf16: bool, reverse: bool
) -> list[float]:
    """``hf_eager`` from ``hf_dir`` over ``batches`` (one microbatch a step), on a device
    freed of the runs before it (the longboat run's CUDA-graph pools and optimizer state: at
    the Qwen3-1.7B shape both runs together exceed 80 GB)."""
    from transformers import AutoModelForCausalLM

    free_memory(acc)
    device = acc.device()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).train()
    factor = ref.lr_factor(cfg.optim.schedule, cfg.train.steps)
    step = ref.HFStep(model, cfg.optim, device, autocast=bf16, lr_factor=factor)
    losses = []
    for i, (b,) in enumerate(batches):
        order = torch.arange(b["tokens"].shape[0] - 1, -1, -1) if reverse else slice(None)
        tokens = b["tokens"][order].to(device)
        targets = torch.where(b["loss_mask"] > 0, b["labels"], -100)[order].to(device)
        losses.append(step(tokens, targets, i))
    return [float(x) for x in losses]


def candidate_table(c: dict[str, Any]) -> str:
    """The candidate run against longboat, within the reference's band."""
    v = c["verdict"]
    header = ["candidate keys", "max abs diff (band)", "mean abs diff (band)", "tail signed mean",
              "passes"]  # fmt: skip
    row = [" ".join(c["keys"]), f"{v['max_diff']:.2e} ({v['band_max_diff']:.2e})",
           f"{v['mean_diff']:.2e} ({v['band_mean_diff']:.2e})",
           f"{v['tail_mean_signed_diff']:+.2e} (limit +-{v['tail_bias_limit']})",
           "yes" if v["passes"] else "no"]  # fmt: skip
    return "vs longboat:\n\n" + md_table(header, [row])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke)")
    p.add_argument("--shape", choices=sorted(lt.SHAPES), default="886m", help="model shape")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--micro-batch", type=int, default=None, help="default 4 (tiny: 2)")
    p.add_argument("--seq", type=int, default=None, help="default 2048 (tiny: 64)")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0, help="the HF model's init")
    p.add_argument("--data-dir", type=Path, default=None, help="where the corpus is built once")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another config key for both sides (e.g. optim.lr=3e-4)",
    )
    p.add_argument("--candidate", action="append", default=[], metavar="KEY=VALUE",
                   help="keys of a second longboat run judged against the first")  # fmt: skip
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps: at least 3")
    from longboat.core.device import get_accelerator

    acc = get_accelerator()
    c = shape(args.tiny, args.micro_batch, args.seq, args.shape)
    cache = args.data_dir or CACHE
    extra = hydra_keys(args.override, "--override")
    with tempfile.TemporaryDirectory(prefix="llm_align_hf_") as hf_dir:
        ov = [
            *lt.shape_overrides(c),
            *lt.moe_overrides(c),
            *data_overrides(c, cache),
            *routing_overrides(c),
            *extra,
            f"model.init_from={hf_dir}",
        ]
        model_cfg = compose("llm", lt.EXPERIMENT, ov[:-1], "unused").model
        torch.manual_seed(args.seed)
        ref.hf_causal_lm(model_cfg, torch.device("cpu")).save_pretrained(hf_dir)
        seen: dict[str, Any] = {}

        def prepare(training: Any) -> None:  # the batches the trainer will train on
            it = training.batches(0)
            seen["batches"] = [next(it) for _ in range(args.steps)]
            seen["precision"] = training.precision

        r = train_timed("llm", lt.EXPERIMENT, ov, acc, warmup=1, steps=args.steps - 2,
                        prepare=prepare, probe=lambda t: {"cfg": t.cfg})  # fmt: skip
        cand_keys = hydra_keys(args.candidate, "--candidate")
        cand = None
        if cand_keys:
            free_memory(acc)
            cand = train_timed("llm", lt.EXPERIMENT, [*ov, *cand_keys], acc, warmup=1,
                               steps=args.steps - 2)  # fmt: skip
        bf16 = seen["precision"] == "bf16"
        curves = {
            name: reference_losses(Path(hf_dir), seen["batches"], r["cfg"], acc, bf16=bf16,
                                   reverse=name.endswith("perturbed"))
            for name in ("reference", "reference_perturbed")
        }  # fmt: skip
    curves["longboat"] = r["losses"]
    if cand is not None:
        curves["candidate"] = cand["losses"]
    config = {**c, "steps": args.steps, "seed": args.seed, "experiment": lt.EXPERIMENT,
              "overrides": ov[:-1], "precision": seen["precision"],
              "reference_autocast_bf16": bf16, "optim": lt._plain(r["cfg"].optim),
              "perturbation": "rows of every batch in reverse order"}  # fmt: skip
    result = result_meta("llm_loss_alignment", acc.device_type != "cpu", lt.PEERS, config)
    result["runs"] = [{"name": k, "losses": v} for k, v in curves.items()]
    result["verdict"] = bench_align.judge(
        curves["longboat"], curves["reference"], curves["reference_perturbed"], relative=False
    )
    if cand is not None:
        # the band: the reference against its perturbed self, as for longboat's own verdict
        cv = bench_align.judge_differences(
            bench_align.differences(curves["candidate"], curves["longboat"], False),
            bench_align.differences(curves["reference_perturbed"], curves["reference"], False),
            relative=False,
        )
        cv["tail_bias_limit"] = CANDIDATE_BIAS
        cv["tail_inside_limit"] = abs(cv["tail_mean_signed_diff"]) <= CANDIDATE_BIAS
        cv["passes"] = cv["passes"] and cv["tail_inside_limit"]
        result["candidate"] = {"keys": cand_keys, "verdict": cv,
                               "median_step_s": cand["timing"].summary(cand["items_per_step"])["median_step_s"]}  # fmt: skip
    diffs = [abs(a - b) for a, b in zip(curves["longboat"], curves["reference"])]
    result["max_abs_loss_diff"] = max(diffs)
    result["mean_abs_loss_diff"] = sum(diffs) / len(diffs)
    result["longboat_median_step_s"] = r["timing"].summary(r["items_per_step"])["median_step_s"]
    title = f"llm_loss_alignment {result['date']} {result['gpu']}: max |dloss| {max(diffs):.4f}"
    tag = "_fp8" if any("fp8" in k for k in cand_keys) else ("_candidate" if cand_keys else "")
    text = bench_align.table(result)
    if cand is not None:
        text += "\n\n" + candidate_table(result["candidate"])
    write_results(result, out=args.out, results_dir=args.results_dir,
                  stem=f"llm_loss_alignment_{'' if args.shape == '886m' else args.shape + '_'}{result['date']}{tag}", table=text,
                  plot=bench_align.plot(result, title))  # fmt: skip
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
