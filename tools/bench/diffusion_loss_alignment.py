"""Diffusion loss alignment: the DiffSynth-style diffusers loop vs ``longboat-diffusion train``
from the same weights on the same latents, noise and timesteps.

    python tools/bench/diffusion_loss_alignment.py [--out results.json] [--tiny] [--steps 200]
        [--frames 17] [--results-dir DIR] [--bf16]

diffusion_throughput's setup at one frame count: one seeded diffusers Wan2.1 T2V-1.3B saved
once (``--tiny``: its 2-block CPU shape), ``--samples`` random latents of ``--frames`` frames at
480x832 with 512-token random captions, read in the same order by every run; step ``i`` draws
its noise level and noise from ``noise_seed(train.seed, i, 0)`` on both sides.

- ``longboat``: ``longboat-diffusion train experiment=finetune`` with the benchmark's weights and
  data, the CLI's defaults for everything else (optimizer, LR schedule, clipping, precision).
- ``reference``: diffusion_throughput's ``hf_ckpt`` (diffusers ``WanTransformer3DModel``, fp32
  weights under bf16 autocast, checkpointing on every block) with the run's optimizer: AdamW at
  the run's LR schedule, weight decay on matrices only, clipping at ``optim.grad_clip``.
- ``reference_perturbed``: the same loop with SDPA kept off cuDNN's attention (flash or
  memory-efficient kernels on CUDA; the math kernel on CPU instead of the CPU flash kernel):
  the same attention, another summation order. Its distance to ``reference`` is the noise band
  (``bench_align``; per-step differences relative to the reference's loss, which swings with
  the noise level drawn each step).

On CPU both sides train in fp32 unless ``--bf16`` (longboat: ``diffusion.cpu_precision=bf16``;
the reference: bf16 autocast over its fp32 weights, as on a GPU).

Writes the curves and the verdict to ``--out`` and
``<results-dir>/diffusion_loss_alignment_<date>.{json,md,png}``; prints the table last.
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import bench_align
import bench_env as env
import diffusion_throughput as dt
from baselines.llm_reference import lr_factor
from bench_train import compose


def off_cudnn(on_gpu: bool) -> Any:
    """SDPA restricted to kernels other than the reference's default (see the module doc)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if on_gpu:
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    return sdpa_kernel([SDPBackend.MATH])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--frames", type=int, default=None, help="frames per clip (4k + 1)")
    p.add_argument("--samples", type=int, default=0, help="generated samples (0: the shape's)")
    p.add_argument("--seed", type=int, default=0, help="weights and data")
    p.add_argument("--bf16", action="store_true", help="on CPU: train in bf16 as on a GPU")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="default: benchmarks/results (none with --tiny)")  # fmt: skip
    args = p.parse_args(argv)
    if args.steps < 4:
        p.error("--steps must be >= 4")
    from longboat.core.device import get_accelerator

    acc = get_accelerator()
    on_gpu = acc.device_type != "cpu"
    if args.results_dir is None and not args.tiny:
        args.results_dir = env.REPO / "benchmarks" / "results"
    c = dict(dt.TINY if args.tiny else dt.FULL)
    c["samples"] = args.samples or c["samples"]
    frames = args.frames or (5 if args.tiny else 17)
    shape = dt.latent_shape(frames, c["latent_hw"])
    # the run functions' knobs: every step recorded, none profiled
    run_args = SimpleNamespace(warmup=1, steps=args.steps - 1, profile_steps=0, profile_dir=None,
                               compile_backend=None)  # fmt: skip
    curves: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="diffusion_align_") as tmp:
        weights, state = dt.make_weights(Path(tmp) / "weights", c["arch"], args.seed)
        samples = dt.make_data(Path(tmp) / "data", c, frames, args.seed)
        base = dt.overrides(weights, Path(tmp) / "data")
        if args.bf16 and not on_gpu:
            base.append("diffusion.cpu_precision=bf16")
        cfg = compose("diffusion", dt.EXPERIMENT, base, str(Path(tmp) / "run"))
        lb = dt.run_longboat("longboat", frames, base, acc, run_args)
        for name, ctx in (("reference", nullcontext()), ("reference_perturbed", off_cudnn(on_gpu))):
            with ctx:
                r = dt.run_baseline("hf_ckpt", frames, c, state, samples, cfg, acc, run_args,
                                    lr_factor=lr_factor(cfg.optim.schedule, cfg.train.steps),
                                    autocast=on_gpu or args.bf16)  # fmt: skip
            curves[name] = r["losses"][: args.steps]
            env.free_memory(acc)
    curves["longboat"] = lb["losses"][: args.steps]
    n = min(len(v) for v in curves.values())
    curves = {k: v[:n] for k, v in curves.items()}
    config = {"model": c["model"], "frames": frames, "latent_shape": [c["arch"]["in_channels"], *shape],
              "video_tokens": dt.video_tokens(shape, c["arch"]["patch_size"]),
              "text_tokens": c["text_len"], "samples": c["samples"], "steps": n,
              "seed": args.seed, "experiment": dt.EXPERIMENT, "overrides": base[2:],
              "precision": "bf16" if on_gpu or args.bf16 else "fp32", "optim": {
                  "lr": cfg.optim.lr, "weight_decay": cfg.optim.weight_decay,
                  "betas": list(cfg.optim.betas), "grad_clip": cfg.optim.grad_clip,
                  "warmup_steps": cfg.optim.schedule.warmup_steps},
              "perturbation": "reference with SDPA kept off cuDNN's attention kernel"}  # fmt: skip
    result = env.result_meta("diffusion_loss_alignment", on_gpu, dt.PEERS, config)
    result["runs"] = [{"name": k, "losses": v} for k, v in curves.items()]
    result["verdict"] = bench_align.judge(
        curves["longboat"], curves["reference"], curves["reference_perturbed"], relative=True
    )
    result["longboat_inputs_seen"] = lb.get("inputs_seen")
    v = result["verdict"]
    title = (f"diffusion_loss_alignment {result['date']} {result['gpu']}: {frames} frames, "
             f"max rel diff {v['max_diff']:.2%} (band {v['band_max_diff']:.2%})")  # fmt: skip
    env.write_results(result, out=args.out, results_dir=args.results_dir,
                      stem=f"diffusion_loss_alignment_{result['date']}",
                      table=bench_align.table(result), plot=bench_align.plot(result, title))  # fmt: skip
    print(bench_align.table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
