"""LLM loss alignment: HF transformers vs longboat from the same weights on the same batches.

    python tools/bench/llm_loss_alignment.py --out results.json [--tiny] [--steps 200]
        [--micro-batch 4] [--seq 2048] [--results-dir DIR] [--override KEY=VALUE ...]
        [--variants longboat,longboat_bf16_moments] [--reference-moe-precision matched]

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
- ``--variants``: the longboat runs (default: ``longboat`` alone), by llm_throughput's
  ``VARIANTS`` names (e.g. ``longboat_bf16_moments``: ``optim.moment_dtype=bf16``), each from the
  same weights on the same batches and judged against the reference within the band: one
  table (the band's row, then one row per run) and one plot. A storage change (bf16 moments)
  proves itself here before the memory planner may choose it by default.
- ``--reference-moe-precision`` (MoE shapes in bf16): ``matched`` (the default) runs the
  reference's MoE layers, and so its band, at longboat's precision: expert GEMMs in bf16 on
  bf16 copies of the fp32 expert weights, the router's GEMM on bf16-rounded operands with fp32
  logits (``llm_reference.match_moe_precision``; under plain autocast transformers' grouped
  expert GEMMs run on the fp32 weights and its router's logits and scores are bf16);
  ``autocast`` keeps transformers as autocast runs it.
- ``candidate`` (with ``--candidate KEY=VALUE ...``, e.g. ``train.precision=fp8``): longboat
  again from the same weights on the same batches with those keys, judged against the
  ``longboat`` run within the same band (``candidate_verdict``; e.g. FP8 against our bf16),
  and also that its mean signed difference over the last 100 steps is inside
  ``+-CANDIDATE_BIAS``.

Writes ``max_abs_loss_diff``, the verdicts (``verdict``: the ``longboat`` run's; ``rows``: every
run's) and the curves to ``--out`` and ``<results-dir>/llm_loss_alignment_[<shape>_]<date>
[_variants].{json,md,png}``; prints the table last.
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


PERTURBATION = "the reference with the rows of every batch in reverse order"
ONE_ROW = (
    " (one row a batch: the same input, so the band is the reference's own run-to-run "
    "variation on the device, e.g. its atomic-add reductions)"
)
"""What the band measures (at micro-batch 1 reversing a batch changes nothing)."""

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


MOE_PRECISIONS = {
    "matched": "the MoE layers at longboat's precision: expert GEMMs in bf16 (bf16 copies of the "
    "fp32 expert weights inside the forward, gradients to the fp32 weights), the router's GEMM "
    "on bf16-rounded operands with fp32 logits and scores",
    "autocast": "as transformers runs under bf16 autocast: expert grouped GEMMs on the fp32 "
    "weights (autocast does not cover them), the router's linear lowered to bf16 (bf16 logits "
    "and scores)",
}
"""``--reference-moe-precision``: how the reference runs its MoE layers in a bf16 run
(``llm_reference.match_moe_precision``; an fp32 run or a dense model has nothing to match)."""


def reference_losses(
    hf_dir: Path,
    batches: list[list[dict]],
    cfg: Any,
    acc: Any,
    *,
    bf16: bool,
    reverse: bool,
    moe_precision: str = "autocast",
    info: dict[str, Any] | None = None,
) -> list[float]:
    """``hf_eager`` from ``hf_dir`` over ``batches`` (one microbatch a step), on a device
    freed of the runs before it (the longboat run's CUDA-graph pools and optimizer state: at
    the Qwen3-1.7B shape both runs together exceed 80 GB). ``moe_precision`` (a
    ``MOE_PRECISIONS`` key): ``matched`` runs the MoE layers of a bf16 run at longboat's
    precision; ``info`` (when given) gets the patched module counts under ``moe_patched``."""
    from transformers import AutoModelForCausalLM

    if moe_precision not in MOE_PRECISIONS:
        raise ValueError(f"moe_precision={moe_precision!r}: one of {sorted(MOE_PRECISIONS)}")
    free_memory(acc)
    device = acc.device()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).train()
    patched = {"experts": 0, "routers": 0}
    if bf16 and moe_precision == "matched":
        patched = ref.match_moe_precision(model)
    if info is not None:
        info["moe_patched"] = patched
    factor = ref.lr_factor(cfg.optim.schedule, cfg.train.steps)
    step = ref.HFStep(model, cfg.optim, device, autocast=bf16, lr_factor=factor)
    losses = []
    for i, (b,) in enumerate(batches):
        order = torch.arange(b["tokens"].shape[0] - 1, -1, -1) if reverse else slice(None)
        tokens = b["tokens"][order].to(device)
        targets = torch.where(b["loss_mask"] > 0, b["labels"], -100)[order].to(device)
        losses.append(step(tokens, targets, i))
    return [float(x) for x in losses]


def variant_names(text: str) -> list[str]:
    """``--variants``: comma-separated names of llm_throughput's ``VARIANTS`` (in order, once
    each); an unknown name stops the script naming the choices."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in lt.VARIANTS]
    if not names or unknown:
        raise SystemExit(f"--variants {text!r}: unknown {unknown or 'empty'}; choose from "
                         + ", ".join(lt.VARIANTS))  # fmt: skip
    return names


def _probe(training: Any) -> dict[str, Any]:
    """The run's config, and what its memory plan chose (a storage choice shows there)."""
    plan = getattr(training, "memory_plan", None)
    line = plan if plan is None or isinstance(plan, str) else plan.line()
    return {"cfg": training.cfg, "memory_plan": line}


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
    p.add_argument("--variants", default="longboat", metavar="NAME[,NAME]",
                   help="longboat runs, each judged against the reference within its band: "
                   "llm_throughput's VARIANTS (" + ", ".join(lt.VARIANTS) + ")")  # fmt: skip
    p.add_argument("--reference-moe-precision", choices=sorted(MOE_PRECISIONS), default="matched",
                   help="the reference's MoE layers in a bf16 run: " + "; ".join(
                       f"{k}: {v}" for k, v in MOE_PRECISIONS.items()))  # fmt: skip
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps: at least 3")
    names = variant_names(args.variants)
    from longboat.core.device import get_accelerator

    acc = get_accelerator()
    c = shape(args.tiny, args.micro_batch, args.seq, args.shape)
    cache = args.data_dir or CACHE
    extra = hydra_keys(args.override, "--override")
    cand_keys = hydra_keys(args.candidate, "--candidate")
    if cand_keys and "longboat" not in names:
        p.error("--candidate is judged against the longboat run: keep longboat in --variants")
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

        runs: dict[str, dict[str, Any]] = {}
        for name in names:
            runs[name] = train_timed("llm", lt.EXPERIMENT, [*ov, *lt.VARIANTS[name]], acc,
                                     warmup=1, steps=args.steps - 2,
                                     prepare=None if seen else prepare, probe=_probe)  # fmt: skip
        cand = None
        if cand_keys:
            cand = train_timed("llm", lt.EXPERIMENT, [*ov, *cand_keys], acc, warmup=1,
                               steps=args.steps - 2)  # fmt: skip
        bf16 = seen["precision"] == "bf16"
        info: dict[str, Any] = {}
        first = runs[names[0]]
        curves = {
            name: reference_losses(Path(hf_dir), seen["batches"], first["cfg"], acc, bf16=bf16,
                                   reverse=name.endswith("perturbed"), info=info,
                                   moe_precision=args.reference_moe_precision)
            for name in ("reference", "reference_perturbed")
        }  # fmt: skip
    for name in names:
        curves[name] = runs[name]["losses"]
    if cand is not None:
        curves["candidate"] = cand["losses"]
    moe = info["moe_patched"]["experts"] + info["moe_patched"]["routers"] > 0
    config = {**c, "steps": args.steps, "seed": args.seed, "experiment": lt.EXPERIMENT,
              "overrides": ov[:-1], "precision": seen["precision"],
              "reference_autocast_bf16": bf16, "optim": lt._plain(first["cfg"].optim),
              "perturbation": PERTURBATION + (ONE_ROW if c["micro_batch"] == 1 else ""),
              "variants": {n: lt.VARIANTS[n] for n in names},
              "reference_moe_precision": args.reference_moe_precision if moe else None,
              "reference_moe_patched": info["moe_patched"]}  # fmt: skip
    if moe:
        config["reference_moe_precision_means"] = MOE_PRECISIONS[args.reference_moe_precision]
    result = result_meta("llm_loss_alignment", acc.device_type != "cpu", lt.PEERS, config)
    result["runs"] = [{"name": k, "losses": v} for k, v in curves.items()]
    result["band"] = bench_align.band_row(
        curves["reference"], curves["reference_perturbed"], relative=False
    )
    result["rows"] = {
        name: {
            "keys": lt.VARIANTS[name],
            "verdict": bench_align.judge(curves[name], curves["reference"],
                                         curves["reference_perturbed"], relative=False),
            "median_step_s": runs[name]["timing"].summary(runs[name]["items_per_step"])["median_step_s"],
            "memory_plan": runs[name]["memory_plan"],
            "moment_dtype": runs[name]["cfg"].optim.moment_dtype or "fp32",
        }
        for name in names
    }  # fmt: skip
    main_name = "longboat" if "longboat" in names else names[0]
    if "longboat" in names:  # the row of the all-stacks table (alignment_table)
        result["verdict"] = result["rows"]["longboat"]["verdict"]
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
    diffs = [abs(a - b) for a, b in zip(curves[main_name], curves["reference"])]
    result["max_abs_loss_diff"] = max(diffs)
    result["mean_abs_loss_diff"] = sum(diffs) / len(diffs)
    result["longboat_median_step_s"] = result["rows"][main_name]["median_step_s"]
    title = (f"llm_loss_alignment {args.shape} {result['date']} {result['gpu']}: "
             f"max |dloss| of {main_name} {max(diffs):.3g}")  # fmt: skip
    tag = "_fp8" if any("fp8" in k for k in cand_keys) else ("_candidate" if cand_keys else "")
    tag += "" if names == ["longboat"] else "_variants"
    text = bench_align.rows_table(result, names)
    if moe:
        text += f"\n\nreference MoE layers ({args.reference_moe_precision}): "
        text += config["reference_moe_precision_means"]
    text += f"\n\nthe band: {config['perturbation']}"
    if cand is not None:
        text += "\n\n" + candidate_table(result["candidate"])
    shape_part = "" if args.shape == "886m" else args.shape + "_"
    write_results(result, out=args.out, results_dir=args.results_dir,
                  stem=f"llm_loss_alignment_{shape_part}{result['date']}{tag}", table=text,
                  plot=bench_align.rows_plot(result, names, title))  # fmt: skip
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
