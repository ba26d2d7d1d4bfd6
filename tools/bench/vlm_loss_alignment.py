"""VLM loss alignment: Hugging Face Qwen2.5-VL vs ``longboat-vlm train`` from the same weights
on the same rows.

    python tools/bench/vlm_loss_alignment.py [--out results.json] [--tiny] [--steps 200]
        [--samples N] [--seed 0] [--bf16] [--results-dir DIR] [--override KEY=VALUE ...]

vlm_throughput's setup: Qwen2.5-VL-3B shapes (``--tiny``: its CPU shape), ``--samples``
generated conversations of four mixed-size images and an answer that fills one packed row of
8,192 tokens each. One seeded ``Qwen2_5_VLForConditionalGeneration`` of those shapes, with the
benchmark tokenizer's token ids, is saved once in fp32; every run starts from it.

- ``longboat``: ``longboat-vlm train experiment=sft`` with the benchmark's data, seq_len and
  global batch 1 (vlm_throughput's ``overrides``) and ``model.init_from`` at the saved
  weights; the CLI's defaults for everything else (optimizer, LR warm-up and cosine decay,
  clipping, bf16 with fp32 main weights started from the checkpoint's values): ``build_training``
  + ``Trainer`` (``bench_train``), plus any ``--override`` (both sides read the optimizer from
  the composed config).
- ``reference``: vlm_throughput's ``hf`` loop (``vlm_reference.HFVLMStep``: fp32 weights under
  bf16 autocast where longboat trains in bf16, SDPA, AdamW decaying matrices only, as
  megatron's parameter groups and the HF Trainer have it, clipping at ``optim.grad_clip``)
  with the run's LR schedule (``lr_factor``), on the rows longboat trained on in its order
  (``training.rows_of_rank``), one sample a step. Its loss is transformers' mean token
  cross-entropy over the labels, which are the row's targets where its loss mask keeps them:
  the quantity longboat's loss is (the masked token losses of the global batch over their
  count), checked row by row.
- ``reference_perturbed``: the reference with SDPA's kernel moved: on CUDA the memory-efficient
  kernel first where it admits the inputs (then flash, cuDNN, math), on CPU the math kernel
  instead of the CPU flash kernel: the same attention, another summation order (the kernels
  each reference run's first step used are in the result). Its distance to ``reference`` is
  the noise band (``bench_align``; per-step differences relative to the reference's loss,
  which moves with the sample of the step).

On CPU both sides train in fp32 unless ``--bf16`` (longboat: ``vlm.cpu_precision=bf16``; the
reference: bf16 autocast over its fp32 weights, as on a GPU).

Writes the curves and the verdict to ``--out`` and
``<results-dir>/vlm_loss_alignment_<date>.{json,md,png}`` (default ``benchmarks/results``; none
with ``--tiny`` unless given); prints the table last.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import bench_align
import bench_env as env
import torch
import vlm_throughput as vt
from baselines import vlm_reference as ref
from baselines.llm_reference import lr_factor
from bench_train import compose, train_timed


def other_kernel(on_gpu: bool) -> AbstractContextManager[Any]:
    """SDPA moved off the reference's default kernel (see the module doc)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if on_gpu:
        order = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
                 SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]  # fmt: skip
        return sdpa_kernel(order, set_priority=True)
    return sdpa_kernel([SDPBackend.MATH])


@contextmanager
def sdpa_kernels(counts: Counter[str]) -> Iterator[None]:
    """Count, by name, the kernel SDPA picks for every attention call inside (torch's own
    choice for those inputs under the active ``sdpa_kernel`` settings): what the perturbation
    moved."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    sdpa = F.scaled_dot_product_attention

    def counted(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                is_causal: bool = False, scale: Any = None,
                enable_gqa: bool = False) -> Any:  # fmt: skip
        qkv = (q, k, v)
        device = q.device.type
        if torch.is_autocast_enabled(device):  # the kernel sees autocast's dtype, not the input's
            qkv = tuple(t.to(torch.get_autocast_dtype(device)) for t in qkv)
        choice = torch._fused_sdp_choice(*qkv, attn_mask, dropout_p, is_causal, scale=scale,
                                         enable_gqa=enable_gqa)  # fmt: skip
        counts[SDPBackend(choice).name.lower()] += 1
        del qkv
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)  # fmt: skip

    F.scaled_dot_product_attention = counted
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


def reference_batch(row: dict[str, Any], model_cfg: Any) -> dict[str, Any]:
    """``row``'s one sample as transformers' inputs (``vlm_reference.hf_batch``), after checking
    that its labels are every target the row's loss counts: a row holding more than one sample,
    or a target at the sample's last token, would give the two sides different losses."""
    batch = ref.hf_batch(row, model_cfg.image_token_id, model_cfg.video_token_id)
    targets = int((batch["labels"] != -100).sum())
    counted = int((row["loss_mask"] > 0).sum())
    if targets != counted:
        raise ValueError(
            f"a packed row counts {counted} targets but its first sample has {targets}: the "
            "reference trains one sample a step (fewer --samples or a longer data.seq_len)"
        )
    return batch


def reference_losses(
    hf_dir: Path, batches: list[dict[str, Any]], cfg: Any, acc: Any, *, autocast: bool
) -> tuple[list[float], dict[str, int]]:
    """The reference from ``hf_dir`` over ``batches`` (one a step) with ``cfg``'s optimizer;
    its losses and the SDPA kernels of its first step."""
    device = acc.device()
    model = ref.load_qwen2_5_vl(hf_dir, device)
    factor = lr_factor(cfg.optim.schedule, cfg.train.steps)
    step = ref.HFVLMStep(model, cfg.optim, device, compiled=False, lr_factor=factor,
                         autocast=autocast)  # fmt: skip
    kernels: Counter[str] = Counter()
    with sdpa_kernels(kernels):
        losses = [step(batches[0], 0)]
    losses += [step(b, i) for i, b in enumerate(batches) if i > 0]
    out = [float(x) for x in losses]
    del step, model, losses
    env.free_memory(acc)
    return out, dict(sorted(kernels.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--samples", type=int, default=0, help="generated samples (0: the shape's)")
    p.add_argument("--seed", type=int, default=0, help="weights and data")
    p.add_argument("--bf16", action="store_true", help="on CPU: train in bf16 as on a GPU")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="default: benchmarks/results (none with --tiny)")  # fmt: skip
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="another config key for both sides (e.g. optim.lr=1e-4)")  # fmt: skip
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps: at least 3")
    from longboat.core.device import get_accelerator

    acc = get_accelerator()
    on_gpu = acc.device_type != "cpu"
    if args.results_dir is None and not args.tiny:
        args.results_dir = env.REPO / "benchmarks" / "results"
    c = dict(vt.TINY if args.tiny else vt.FULL)
    c["samples"] = args.samples or c["samples"]
    extra = [f"{k}={v}" for k, v in env.key_values(args.override, "--override").items()]
    if args.bf16 and not on_gpu:
        extra.append("vlm.cpu_precision=bf16")
    with tempfile.TemporaryDirectory(prefix="vlm_align_") as tmp:
        data, tok = vt.make_data(Path(tmp), c, args.seed)
        base = [*vt.overrides(c, data, tok), *extra]
        model_cfg, _, tokens, _ = vt.measure_rows(compose("vlm", vt.EXPERIMENT, base, tmp))
        hf_dir = Path(tmp) / "hf"
        torch.manual_seed(args.seed)
        ref.hf_qwen2_5_vl(model_cfg, torch.device("cpu")).save_pretrained(hf_dir)
        seen: dict[str, Any] = {}

        def prepare(training: Any) -> None:  # the rows the trainer will train on, in order
            plan = [training.rows_of_rank(s) for s in range(args.steps)]
            if any(len(rows) != 1 for rows in plan):
                raise SystemExit("the reference trains one row a step: keep the global batch 1")
            seen["rows"] = [i for (i,) in plan]
            rows = training.data.train  # each distinct row built once, shared by its steps
            built = {i: reference_batch(rows[i], training.model_cfg) for i in set(seen["rows"])}
            seen["batches"] = [built[i] for i in seen["rows"]]
            seen["precision"] = training.precision
            seen["exact_main_weights"] = training.exact_main_weights

        ov = [*base, f"model.init_from={hf_dir}"]
        lb = train_timed("vlm", vt.EXPERIMENT, ov, acc, warmup=1, steps=args.steps - 2,
                         prepare=prepare, probe=lambda t: {"cfg": t.cfg,
                                                           "describe": t.describe()})  # fmt: skip
        cfg, autocast = lb["cfg"], seen["precision"] == "bf16"
        curves: dict[str, list[float]] = {}
        kernels: dict[str, dict[str, int]] = {}
        for name, ctx in (("reference", nullcontext()),
                          ("reference_perturbed", other_kernel(on_gpu))):  # fmt: skip
            with ctx:
                curves[name], kernels[name] = reference_losses(hf_dir, seen["batches"], cfg, acc,
                                                               autocast=autocast)  # fmt: skip
    curves["longboat"] = [float(x) for x in lb["losses"]]
    n = min(len(v) for v in curves.values())
    curves = {k: v[:n] for k, v in curves.items()}
    shown = [o for o in base if not o.startswith(("data.paths", "data.tok"))]
    config = {"model": c["model"], "seq_len": c["seq"], "images": [list(x) for x in c["images"]],
              "samples": c["samples"], "mean_tokens": tokens, "rows_in_order": seen["rows"][:n],
              "steps": n, "seed": args.seed, "experiment": vt.EXPERIMENT, "overrides": shown,
              "init": "one seeded HF Qwen2_5_VLForConditionalGeneration, saved in fp32",
              "precision": seen["precision"], "reference_autocast_bf16": autocast,
              "exact_main_weights": seen["exact_main_weights"], "optim": {
                  "lr": cfg.optim.lr, "weight_decay": cfg.optim.weight_decay,
                  "betas": list(cfg.optim.betas), "eps": cfg.optim.eps,
                  "grad_clip": cfg.optim.grad_clip, "schedule": cfg.optim.schedule.name,
                  "warmup_steps": cfg.optim.schedule.warmup_steps,
                  "min_lr_ratio": cfg.optim.schedule.min_lr_ratio, "train_steps": cfg.train.steps},
              "perturbation": "reference with SDPA moved off its default kernel ("
              + ("memory-efficient first" if on_gpu else "math instead of the CPU flash kernel")
              + ")",
              "sdpa_kernels_first_step": kernels,
              "differences": "relative to the reference's loss"}  # fmt: skip
    result = env.result_meta("vlm_loss_alignment", on_gpu, vt.PEERS, config)
    result["runs"] = [{"name": k, "losses": v} for k, v in curves.items()]
    result["verdict"] = bench_align.judge(
        curves["longboat"], curves["reference"], curves["reference_perturbed"], relative=True
    )
    diffs = [abs(a - b) for a, b in zip(curves["longboat"], curves["reference"])]
    result["max_abs_loss_diff"] = max(diffs)
    result["max_rel_loss_diff"] = result["verdict"]["max_diff"]
    result["longboat_describe"] = lb["describe"]
    v = result["verdict"]
    title = (f"vlm_loss_alignment {result['date']} {result['gpu']}: {c['model']}, "
             f"max rel diff {v['max_diff']:.2%} (band {v['band_max_diff']:.2%})")  # fmt: skip
    env.write_results(result, out=args.out, results_dir=args.results_dir,
                      stem=f"vlm_loss_alignment_{result['date']}", table=bench_align.table(result),
                      plot=bench_align.plot(result, title))  # fmt: skip
    print(bench_align.table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
