"""Video DiT training throughput: a DiffSynth-style diffusers Wan loop vs ``longboat-diffusion
train``, one process.

    python tools/bench/diffusion_throughput.py [--out results.json] [--tiny] [--steps N]
        [--warmup N] [--frames 49,81] [--runs hf_ckpt,hf_compiled,longboat,...]
        [--results-dir DIR] [--time-budget S] [--profile-steps N --profile-dir DIR]

Model: Wan2.1 T2V-1.3B shapes (30 blocks x 1536, 12 heads, FFN 8960, text dim 4096, patch
1x2x2), one seeded diffusers ``WanTransformer3DModel`` saved once; every run starts from those
weights (``longboat`` reads the directory through the family's load path, ``model.init_from``).
Data: ``--samples`` random latents per frame count at 480x832 (49 frames: 16x13x60x104, 20,280
tokens; 81 frames: 16x21x60x104, 32,760 tokens), each with 512 random text-embedding tokens of
width 4096 (seeded; one latent dataset per frame count, written in the product's format, read by
every run in the same order). ``--tiny``: a 2-block Wan with a few tokens, for the CPU smoke.

Runs, for each frame count:
- ``hf_ckpt`` (the reference) / ``hf_compiled``: ``baselines/wan_reference.py`` (its docstring
  lists how it differs from DiffSynth-Studio's trainer): checkpointing on every block, eager /
  every block compiled, no checkpointing.
- ``longboat``: ``longboat-diffusion train experiment=finetune`` with the benchmark's weights,
  data, unshuffled order and global batch 1 (``overrides``), everything else the CLI's defaults:
  ``build_training`` run by core's ``Trainer``. ``longboat_<variant>``: plus ``VARIANTS``' keys.

Every run draws step ``i``'s noise level and noise from the seed ``noise_seed(train.seed, i, 0)``
(the product's per-step seed), so weights, latents, noise and timesteps are shared; a forward
pre-hook records the first steps' timesteps and the sums of the noised latents each model saw,
and the results say whether they are identical across runs (``checks``) and how far each run's
step-0 loss is from the reference's (``STEP0_TOL``: bf16 on a GPU, fp32 on CPU).

Per run: median step time (steps back to back, device events between steps), samples/s, video
tokens/s, MFU (``flops_per_sample``: model FLOPs, 3x the forward's matmuls and attention,
recompute not counted), peak memory, the losses. Writes ``--out`` and
``<results-dir>/diffusion_throughput_<date>.{json,md,png}`` (default results dir:
benchmarks/results, none with ``--tiny``); prints the table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_env as env
import torch
from baselines import wan_reference as ref
from bench_env import failed_row, fmt, md_table
from bench_profile import profile_steps
from bench_timing import time_loop
from bench_train import compose, train_timed

EXPERIMENT = "finetune"
FULL = dict(model="wan_t2v_1_3b", arch=ref.WAN_T2V_1_3B, latent_hw=(60, 104), text_len=512,
            samples=4, frames=(49, 81))  # fmt: skip
TINY = dict(model="wan_tiny", arch=ref.WAN_TINY, latent_hw=(4, 6), text_len=8, samples=3,
            frames=(5, 9))  # fmt: skip
VARIANTS: dict[str, list[str]] = {
    "longboat": [],
    "longboat_recompute": ["train.recompute=selective"],
    "longboat_recompute_full": ["train.recompute=full"],
}
"""Config keys each longboat run adds to the CLI's defaults."""
ALL_RUNS = ("hf_ckpt", "hf_compiled", "longboat")
REFERENCE = "hf_ckpt"
TARGET_VS_REFERENCE = 2.2
"""The target for ``longboat`` against the reference (benchmarks/notes/diffusion.md; drawn in the
chart)."""
PEERS = ("diffusers", "megatron-core", "triton")
RUN_WEIGHT = {"hf_compiled": 2.0}
STEP0_TOL = {"bf16": 2e-2, "fp32": 1e-4}
"""Largest relative step-0 loss difference from the reference: bf16 (GPU: bf16 matmuls and
attention in different kernels over 30 blocks), fp32 (CPU: summation order only)."""
PROBE_STEPS = 2
"""Steps whose model inputs are recorded (warm-up steps: the record reads the device)."""


def latent_shape(frames: int, hw: tuple[int, int]) -> tuple[int, int, int]:
    """Latent (T, H, W) of ``frames`` video frames: the Wan VAE keeps the first frame and
    compresses the rest 4x in time (``1 + (frames - 1) / 4``)."""
    if frames < 1 or (frames - 1) % 4:
        raise SystemExit(f"--frames {frames}: Wan clips have 4k + 1 frames (49, 81)")
    return (1 + (frames - 1) // 4, *hw)


def video_tokens(shape: tuple[int, int, int], patch: list[int]) -> int:
    return math.prod(s // p for s, p in zip(shape, patch, strict=True))


def flops_per_sample(arch: dict[str, Any], tokens: int, text_len: int) -> float:
    """Training FLOPs of one sample of ``tokens`` video tokens and ``text_len`` caption tokens
    of the diffusers Wan config ``arch``, as the wan family counts them
    (``Family.flops_per_sample``)."""
    from longboat.core.family import find_family
    from longboat.diffusion.models.wan import WanConfig

    wan = find_family("diffusion", "wan")
    return wan.flops_per_sample(WanConfig.from_diffusers(arch), tokens, text_len)


def make_weights(out: Path, arch: dict[str, Any], seed: int) -> tuple[Path, dict]:
    """One seeded diffusers Wan saved as a diffusers directory (fp32); returns it and its
    state dict (CPU)."""
    torch.manual_seed(seed)
    model = ref.hf_wan(arch, torch.device("cpu"))
    model.save_pretrained(str(out), safe_serialization=True)
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_data(
    out: Path, c: dict[str, Any], frames: int, seed: int
) -> list[dict[str, torch.Tensor]]:
    """``c["samples"]`` random latents of ``frames`` frames with their text embeddings, written
    as a latent dataset under ``out``; returns them (float32, CPU)."""
    from longboat.diffusion.data.shards import (
        LatentRecord,
        new_manifest,
        write_manifest,
        write_shard,
    )

    gen = torch.Generator().manual_seed(seed * 1000 + frames)
    shape = latent_shape(frames, c["latent_hw"])
    arch = c["arch"]
    samples, records = [], []
    for i in range(c["samples"]):
        lat = torch.randn(arch["in_channels"], *shape, generator=gen)
        txt = torch.randn(c["text_len"], arch["text_dim"], generator=gen)
        samples.append({"latents": lat, "text": txt})
        records.append(LatentRecord(latents=lat, text_embeds=txt, caption=f"sample {i}",
                                    source="diffusion_throughput", frames=frames))  # fmt: skip
    manifest = new_manifest(latent_channels=arch["in_channels"], text_dim=arch["text_dim"],
                            dtype="float32", encoders={"vae": "none (random latents)",
                            "text_encoder": "none (random embeddings)"},
                            options={"generator": "diffusion_throughput", "frames": frames,
                                     "seed": seed})  # fmt: skip
    manifest["shards"].append(write_shard(out, 0, records, "float32").to_json())
    manifest["complete"] = True
    write_manifest(out, manifest)
    return samples


def overrides(weights: Path, data: Path) -> list[str]:
    """The benchmark's weights, data and batch on top of ``experiment=finetune``."""
    return [f"model.init_from={weights}", f"data.paths=[{data}]", "data.shuffle=false",
            "train.global_batch_size=1", "train.eval_every=0"]  # fmt: skip


class InputProbe:
    """A forward pre-hook recording, for the first ``n`` calls, the timesteps and the sum and
    absolute sum (float64) of the noised latents a model gets (its first two arguments)."""

    def __init__(self, module: torch.nn.Module, n: int) -> None:
        self.n, self.seen = n, []
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        if len(self.seen) >= self.n or not torch.is_grad_enabled():
            return
        x = args[0] if args else kwargs.get("hidden_states", kwargs.get("latents"))
        t = args[1] if len(args) > 1 else kwargs.get("timestep", kwargs.get("timesteps"))
        x = x.detach().double()
        self.seen.append({"timesteps": [float(v) for v in t.detach().flatten().tolist()],
                          "x_t_sum": float(x.sum()), "x_t_abs_sum": float(x.abs().sum())})  # fmt: skip

    def close(self) -> list[dict[str, Any]]:
        self.handle.remove()
        return self.seen


def run_longboat(name: str, frames: int, base: list[str], acc: Any, args: Any) -> dict:
    probe: dict[str, InputProbe] = {}

    def prepare(training: Any) -> None:
        probe["p"] = InputProbe(training.step_fn.model, PROBE_STEPS)

    def describe(training: Any) -> dict[str, Any]:
        return {"precision": training.precision, "describe": training.describe(),
                "inputs_seen": probe["p"].close()}  # fmt: skip

    out = args.profile_dir and args.profile_dir / f"diffusion_profile_{name}_{frames}f.txt"
    return train_timed("diffusion", EXPERIMENT, [*base, *VARIANTS[name]], acc,
                       warmup=args.warmup, steps=args.steps, profile_steps=args.profile_steps,
                       profile_out=out, prepare=prepare, probe=describe)  # fmt: skip


def run_baseline(
    name: str,
    frames: int,
    c: dict,
    state: dict,
    samples: list,
    cfg: Any,
    acc: Any,
    args: Any,
    lr_factor: Any = None,
    autocast: bool | None = None,
) -> dict[str, Any]:
    from longboat.diffusion.train.data import noise_seed

    device = acc.device()
    leftover = env.free_memory(acc)
    t0 = time.perf_counter()
    model = ref.hf_wan(c["arch"], device, state)
    step = ref.WanRefStep(
        model, cfg.optim, device, compiled=name == "hf_compiled", shift=cfg.objective.shift,
        num_train_timesteps=cfg.objective.num_train_timesteps, compile_backend=args.compile_backend,
        lr_factor=lr_factor, autocast=autocast,
    )  # fmt: skip
    build_s = time.perf_counter() - t0
    probe = InputProbe(model, PROBE_STEPS)
    seed = cfg.train.seed

    def batch(i: int) -> dict[str, Any]:
        s = samples[i % len(samples)]
        return {"latents": s["latents"][None], "text": s["text"][None],
                "seed": noise_seed(seed, i, 0), "step": i}  # fmt: skip

    batches = (batch(i) for i in itertools.count())
    timing, losses = time_loop(acc, batches, lambda b, i: step(b), args.warmup, args.steps)
    notes: dict[str, Any] = {"forward": step.forward_module, "checkpointing": step.checkpointing,
                             "compiled_blocks": name == "hf_compiled"}  # fmt: skip
    out = args.profile_dir and args.profile_dir / f"diffusion_profile_{name}_{frames}f.txt"
    done = args.warmup + args.steps
    summary = profile_steps(acc, lambda i: step(batch(done + i)), args.profile_steps, out)
    if summary:
        notes["profile"] = summary
    peak = acc.memory_stats().get("peak_allocated_gb", 0.0)
    return {"timing": timing, "losses": losses, "peak_mem_gb": peak, "build_s": build_s,
            "items_per_step": 1, "allocated_at_start_gb": leftover, "precision": step.precision,
            "inputs_seen": probe.close(), "notes": notes}  # fmt: skip


def entry(name: str, frames: int, r: dict[str, Any], tokens: int, flops: float) -> dict[str, Any]:
    """Per-step rates from the median step (one sample a step)."""
    s = r.pop("timing").summary(1)
    step_s = s["median_step_s"]
    return {"name": name, "frames": frames, "samples_per_s": 1.0 / step_s,
            "tokens_per_s": tokens / step_s, "mfu": flops / step_s / env.PEAK_BF16_FLOPS,
            "peak_mem_gb": r.pop("peak_mem_gb"), **s, **r}  # fmt: skip


def check_runs(result: dict[str, Any], tol: float) -> None:
    """``result["checks"]`` per frame count: the inputs every run saw equal the reference's
    (timesteps exactly, latent sums within 1e-6 relative) and each run's step-0 loss within
    ``tol`` of the reference's."""
    checks = {}
    for frames in result["config"]["frames"]:
        runs = [r for r in result["runs"] if r.get("frames") == frames and "losses" in r]
        ref_run = next((r for r in runs if r["name"] == REFERENCE), runs[0] if runs else None)
        if ref_run is None:
            continue
        want, loss0 = ref_run["inputs_seen"], ref_run["losses"][0]
        same, rel = {}, {}
        for r in runs:
            seen = r["inputs_seen"]
            same[r["name"]] = len(seen) == len(want) > 0 and all(
                a["timesteps"] == b["timesteps"]
                and abs(a["x_t_sum"] - b["x_t_sum"]) <= 1e-6 * b["x_t_abs_sum"]
                and abs(a["x_t_abs_sum"] - b["x_t_abs_sum"]) <= 1e-6 * b["x_t_abs_sum"]
                for a, b in zip(seen, want)
            )
            rel[r["name"]] = abs(r["losses"][0] - loss0) / abs(loss0)
        checks[str(frames)] = {
            "reference": ref_run["name"], "inputs_identical": same,
            "step0_rel_loss_diff": rel, "step0_tolerance": tol,
            "step0_agree": all(v <= tol for v in rel.values()),
            "noise_identical": all(same.values()),
        }  # fmt: skip
    result["checks"] = checks


def table(result: dict[str, Any]) -> str:
    header = ["run", "frames", "samples/s", "vs hf_ckpt", "vs hf_compiled", "tokens/s", "MFU",
              "peak mem (GB)", "median step (s)", "step-0 loss"]  # fmt: skip
    rows = []
    for r in result["runs"]:
        if "samples_per_s" not in r:
            rows.append(failed_row(r, len(header)))
            continue
        peers = {p["name"]: p for p in result["runs"]
                 if p.get("frames") == r["frames"] and "samples_per_s" in p}  # fmt: skip
        ratios = [f"{r['samples_per_s'] / peers[b]['samples_per_s']:.2f}x" if b in peers else "-"
                  for b in ("hf_ckpt", "hf_compiled")]  # fmt: skip
        rows.append([r["name"], str(r["frames"]), fmt(r["samples_per_s"], ".3f"), *ratios,
                     fmt(r["tokens_per_s"], ".1f", 1e-3, "k"), fmt(r["mfu"], ".1%"),
                     fmt(r["peak_mem_gb"], ".1f"), fmt(r["median_step_s"]),
                     fmt(r["losses"][0], ".5f")])  # fmt: skip
    lines = [md_table(header, rows)]
    for frames, c in result.get("checks", {}).items():
        worst = max(c["step0_rel_loss_diff"].values())
        lines.append(
            f"- {frames} frames: noise and timesteps "
            f"{'identical' if c['noise_identical'] else 'NOT identical'} across runs; step-0 "
            f"loss vs {c['reference']}: max rel diff {worst:.2e} "
            f"({'within' if c['step0_agree'] else 'OUTSIDE'} {c['step0_tolerance']:g})"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any]) -> Any:
    """One panel per frame count: each run's speed against the reference (y) over its peak
    memory (x), the trade-off between the runs at a glance."""
    runs = [r for r in result["runs"] if "samples_per_s" in r]
    frames = sorted({r["frames"] for r in runs})
    title = f"diffusion_throughput {result['date']} {result['gpu']}: {result['config']['model']}"

    def draw(plt: Any) -> Any:
        fig, axes = plt.subplots(1, len(frames), figsize=(6.5 * len(frames), 4.5), squeeze=False)
        for ax, f in zip(axes[0], frames, strict=True):
            mine = [r for r in runs if r["frames"] == f]
            ref = next((r for r in mine if r["name"] == REFERENCE), None)
            base = ref["samples_per_s"] if ref else 1.0
            for r in mine:
                x, y = r["peak_mem_gb"], r["samples_per_s"] / base
                color = "tab:blue" if r["name"].startswith("longboat") else "tab:gray"
                ax.scatter([x], [y], color=color, s=40)
                ax.annotate(r["name"], (x, y), textcoords="offset points", xytext=(5, 4),
                            fontsize=8)  # fmt: skip
            if ref:
                ax.axhline(TARGET_VS_REFERENCE, ls="--", color="tab:red", lw=1)
                ax.axvline(ref["peak_mem_gb"], ls=":", color="tab:gray", lw=1)
                ax.annotate(f"target {TARGET_VS_REFERENCE}x at <= {REFERENCE}'s memory",
                            (0, TARGET_VS_REFERENCE), textcoords="offset points",
                            xytext=(4, -12), fontsize=8, color="tab:red")  # fmt: skip
            ax.set_xlabel("peak memory (GB)")
            ax.set_ylabel(f"samples/s vs {REFERENCE}" if ref else "samples/s")
            tokens = result["config"]["video_tokens"]  # int keys here, str after JSON
            ax.set_title(f"{f} frames ({tokens.get(f, tokens.get(str(f))):,} tokens)")
            ax.set_xlim(left=0)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()
        return fig

    return lambda plt: runs and draw(plt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--frames", default=None, help="comma list of frame counts (4k + 1)")
    p.add_argument("--samples", type=int, default=0, help="generated samples (0: the shape's)")
    p.add_argument("--runs", default=None, help=f"comma list out of {','.join(ALL_RUNS)}, "
                   f"{','.join(v for v in VARIANTS if v != 'longboat')}")  # fmt: skip
    p.add_argument("--results-dir", type=Path, default=None,
                   help="default: benchmarks/results (none with --tiny)")  # fmt: skip
    p.add_argument("--time-budget", type=float, default=0)
    p.add_argument("--seed", type=int, default=0, help="weights and data")
    p.add_argument("--profile-steps", type=int, default=0)
    p.add_argument("--profile-dir", type=Path, default=None)
    p.add_argument("--compile-backend", default=None,
                   help="hf_compiled's torch.compile backend (default: inductor; "
                   "aot_eager with --tiny, so the smoke traces the blocks without codegen)")  # fmt: skip
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    args.warmup = max(args.warmup, PROBE_STEPS)  # the probes read the device: untimed steps
    args.compile_backend = args.compile_backend or ("aot_eager" if args.tiny else "inductor")
    from longboat.core.device import get_accelerator

    acc = get_accelerator()
    on_gpu = acc.device_type != "cpu"
    if args.results_dir is None and not args.tiny:
        args.results_dir = env.REPO / "benchmarks" / "results"
    c = dict(TINY if args.tiny else FULL)
    c["samples"] = args.samples or c["samples"]
    frames_list = [int(f) for f in args.frames.split(",")] if args.frames else list(c["frames"])
    runs = args.runs.split(",") if args.runs else list(ALL_RUNS)
    unknown = [r for r in runs if r not in (*ALL_RUNS, *VARIANTS)]
    if unknown:
        p.error(f"--runs: unknown {unknown}; use {', '.join((*ALL_RUNS, *VARIANTS))}")
    precision = "bf16" if on_gpu else "fp32"
    arch = c["arch"]
    shapes = {f: latent_shape(f, c["latent_hw"]) for f in frames_list}
    tokens = {f: video_tokens(shapes[f], arch["patch_size"]) for f in frames_list}
    flops = {f: flops_per_sample(arch, tokens[f], c["text_len"]) for f in frames_list}
    config = {"model": c["model"], "arch": arch, "frames": frames_list,
              "latent_shapes": {str(f): [arch["in_channels"], *shapes[f]] for f in frames_list},
              "video_tokens": {str(f): tokens[f] for f in frames_list},
              "text_tokens": c["text_len"], "samples": c["samples"], "batch": 1,
              "flops_per_sample": {str(f): flops[f] for f in frames_list},
              "steps": args.steps, "warmup": args.warmup, "precision": precision,
              "compile_backend": args.compile_backend, "variants": VARIANTS,
              "step0_tolerance": STEP0_TOL[precision], "peak_flops": env.PEAK_BF16_FLOPS,
              "init": "one seeded diffusers WanTransformer3DModel (fp32), longboat via "
                      "model.init_from"}  # fmt: skip
    result = env.result_meta("diffusion_throughput", on_gpu, PEERS, config)
    with tempfile.TemporaryDirectory(prefix="diffusion_bench_") as tmp:
        weights, state = make_weights(Path(tmp) / "weights", arch, args.seed)
        data = {f: make_data(Path(tmp) / f"data_{f}", c, f, args.seed) for f in frames_list}
        base = {f: overrides(weights, Path(tmp) / f"data_{f}") for f in frames_list}
        cfg = compose("diffusion", EXPERIMENT, base[frames_list[0]], str(Path(tmp) / "run"))
        config["overrides"] = [o for o in base[frames_list[0]] if not o.startswith(("model.init",
                               "data.paths"))]  # fmt: skip
        config["objective"] = {"shift": cfg.objective.shift,
                               "timestep_sampling": cfg.objective.timestep_sampling,
                               "weighting": cfg.objective.weighting}  # fmt: skip

        def run_one(key: str) -> dict[str, Any]:
            name, frames = key.rsplit("@", 1)
            f = int(frames)
            if name in VARIANTS:
                r = run_longboat(name, f, base[f], acc, args)
            else:
                r = run_baseline(name, f, c, state, data[f], cfg, acc, args)
            return entry(name, f, r, tokens[f], flops[f])

        def write() -> None:
            for r in result["runs"]:  # a failed run keeps its key: name and frame count
                if "@" in r["name"]:
                    r["name"], frames = r["name"].rsplit("@", 1)
                    r["frames"] = int(frames)
            check_runs(result, STEP0_TOL[precision])
            env.write_results(result, out=args.out, results_dir=args.results_dir,
                              stem=f"diffusion_throughput_{result['date']}{'_tiny' if args.tiny else ''}", table=table(result),
                              plot=plot(result), note=f"config: {json.dumps(config)}")  # fmt: skip

        keys = [f"{r}@{f}" for f in frames_list for r in runs]
        # the budget covers everything: what the weights and data took is spent
        left = args.time_budget - (time.perf_counter() - t_start) if args.time_budget else 0.0
        env.run_all(keys, run_one, result, write, time_budget=max(left, 1e-3) if args.time_budget else 0.0,
                    weights={k: RUN_WEIGHT.get(k.split("@")[0], 1.0) for k in keys},
                    describe=lambda r: f"{r['samples_per_s']:.3f} samples/s, "
                    f"peak {r['peak_mem_gb']:.1f} GB, step-0 loss {r['losses'][0]:.5f}, "
                    f"build {r['build_s']:.1f}s")  # fmt: skip
    write()
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
