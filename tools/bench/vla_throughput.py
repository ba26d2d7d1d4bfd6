"""VLA training throughput: the reference GR00T-N1.6 (or pi0.5) loop vs longboat-embodied.

    python tools/bench/vla_throughput.py --out results.json [--model groot_n1_6|pi05]
        [--batch 32] [--steps 20] [--warmup 5] [--workers 8] [--tiny] [--runs ...]
        [--results-dir DIR] [--time-budget S] [--override KEY=JSON ...]

Every run trains the same shapes (longboat's ``full`` config; ``tiny`` with ``--tiny``) on the
same synthetic LeRobot v2.1 dataset (``make_dataset``: several embodiments, 2 cameras, 256x256 at
full shapes), random init, bf16, the same batch size and loader worker count:

- ``reference``: ``baselines/groot_n1_6_reference.py`` (transformers modules, whole-episode decode
  + PIL + processor in DataLoader workers, eager, HF-Trainer step) or, with ``--model pi05``,
  ``baselines/pi05_reference.py`` (openpi's PyTorch training: bf16 weights with fp32 norms,
  gradient checkpointing, eager attention with a 4D mask, the prompt padded to ``max_token_len``,
  on-device augmentation, per-sample decode + PIL in the workers). Each file lists how it differs
  from the official code.
- ``lean``: ``baselines/vla_lean.py``, the policy's own model math in plain eager PyTorch (torch
  reference ops, fp32 trainable weights under autocast, fused AdamW) on synthetic batches made
  once on the device: no data loading, no LM head, no thrown-away work.
- ``longboat``: ``longboat-embodied train experiment=<model>_tiny`` with only the benchmark's model
  size (``model=<model>``), ``train.precision=bf16``, batch, steps and data (``data.path``,
  ``data.num_workers``): the stack's ``build_training`` run by core's ``Trainer``, the CLI's
  defaults for every lever. ``longboat_<variant>``: the same plus the keys of ``VARIANTS``.

pi0.5: the reference pads every prompt to ``max_token_len`` (200: a 968-token prefix) as openpi
does, longboat to the batch's longest text; ``--override max_token_len=64`` shows how much of the
ratio that is. The losses are not comparable: openpi averages over every padded action dim,
longboat masks them.

Per run: samples/s over the timed window's wall clock (data loading included), the median device
step (``bench_timing``: steps back to back, device events between them; a loop reading its loss
every step, as the reference's ``loss.item()``, pays that sync in its step), the host's median
batch wait and loop iteration, peak device memory, MFU from the policy family's analytic count
of the useful FLOPs (``flops_per_sample``; the reference's discarded LM head not counted)
against 989 TFLOP/s. A run over its share of
``--time-budget`` fails alone. Writes ``<results-dir>/vla_throughput_<date>[_pi05][_tiny]
.{json,md,png}`` and ``--out``; prints the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import bench_env as env
import torch
from baselines import groot_n1_6_reference as groot_ref
from baselines import groot_n1_6_reference_data as groot_data
from baselines import pi05_reference as pi05_ref
from baselines import pi05_reference_data as pi05_data
from baselines import vla_lean
from bench_env import failed_row, fmt, md_table
from bench_profile import profile_steps
from bench_timing import time_loop
from bench_train import model_overrides, train_timed

EXPERIMENT = {"groot_n1_6": "groot_n1_6_tiny", "pi05": "pi05_tiny"}
GRAPHED = ["train.master_weights=true", "train.cuda_graph=true"]
VARIANTS: dict[str, list[str]] = {
    "longboat": [],
    "longboat_autocast": ["train.master_weights=false"],
    "longboat_compiled": ["train.compile=true"],
    "longboat_master": ["train.master_weights=true", "train.cuda_graph=false"],
    "longboat_graphed": GRAPHED,
    "longboat_graphed_fp32master": [*GRAPHED, "train.master_weight_storage=fp32"],
    "longboat_graphed_slices": [*GRAPHED, "train.master_weight_update=slices"],
    "longboat_fsdp": ["parallel.strategy=fsdp"],
}
"""Config keys each longboat run adds to the CLI's defaults (with bf16 on CUDA: master
weights, the CUDA-graphed step and the one-pass kernel update). ``longboat_autocast``: fp32
params under autocast (eager); ``longboat_master``: master weights, eager steps;
``longboat_fsdp``: FSDP2 instead of DDP (at one process both train the model unwrapped; no
master weights)."""
PROFILE_PARTS = {"groot_n1_6": ("groot_n1_6.backbone", "groot_n1_6.action_head")}
"""The model's ``record_function`` ranges a profile splits the step into (eager steps only:
a replayed CUDA graph runs no op to attribute)."""
PEERS = ("transformers", "av", "triton")
"""The distributions whose versions the result records."""
TEXT_LEN = 24  # prompt tokens the FLOP counts assume


def _write_one_embodiment(job: tuple[str, int, int, int, int, int, int, tuple[int, int]]) -> str:
    """Worker: write one embodiment's v2.1 dataset (embodiment id ``emb``)."""
    from longboat.embodied.data.synthetic import EmbodimentSpec, write_synthetic_dataset

    root, emb, episodes, lo, hi, sdim, adim, hw = job
    spec = EmbodimentSpec(name=f"robot{emb}", state_dim=sdim, action_dim=adim)
    # Neither loop reads the image statistics: a subsample keeps their quantiles cheap.
    write_synthetic_dataset(root, layout="v2.1", num_episodes=episodes, episode_length=(lo, hi),
                            image_size=hw, embodiments=(spec,), embodiment_ids=(emb,), seed=emb,
                            image_stats_stride=(10, 8, 8))  # fmt: skip
    return root


def make_dataset(
    root: Path, *, embodiments: int, episodes: int, length: tuple[int, int],
    hw: tuple[int, int], max_state: int, max_action: int,
) -> list[Path]:  # fmt: skip
    """Write (once, in parallel) one LeRobot v2.1 dataset per embodiment under ``root``."""
    roots = [root / f"robot{e}" for e in range(embodiments)]
    done = root / ".complete"
    if done.exists():
        return roots
    jobs = [
        (str(r), e, episodes, length[0], length[1], min(max_state, 6 + 2 * e),
         min(max_action, 5 + 2 * e), hw)
        for e, r in enumerate(roots)
    ]  # fmt: skip
    with ProcessPoolExecutor(max_workers=min(embodiments, os.cpu_count() or 1)) as pool:
        list(pool.map(_write_one_embodiment, jobs))
    done.write_text("ok\n")
    return roots


def dataset_for(args: Any, cfg: Any, hw: tuple[int, int]) -> Path:
    """The benchmark's dataset root (``--data-dir`` or one per flavour and frame size)."""
    flavor = "tiny" if args.tiny else "full"
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    root = args.data_dir or tmp / f"vla_bench_{flavor}_{hw[0]}x{hw[1]}"
    max_action = getattr(cfg, "max_action_dim", None) or cfg.action_dim
    make_dataset(root, embodiments=args.embodiments, episodes=args.episodes,
                 length=tuple(args.episode_length), hw=hw, max_state=cfg.max_state_dim,
                 max_action=max_action)  # fmt: skip
    return root


def flops_per_sample(model: str, cfg: Any, n_cams: int, image_hw: tuple[int, int]) -> float:
    """Useful training FLOPs of one sample of ``n_cams`` frames of ``image_hw`` and
    ``TEXT_LEN`` prompt tokens: the policy family's ``flops_per_sample``."""
    from longboat.embodied.models import policy

    count = policy(model).flops_per_sample
    if count is None:
        raise SystemExit(f"policy {model!r} declares no flops_per_sample: no MFU to report")
    return count(cfg, n_cams, image_hw, TEXT_LEN)


def longboat_overrides(args: Any, root: Path, world: int = 1) -> list[str]:
    """The benchmark's model size, precision, batch (per rank) and data on the experiment;
    prompts through the byte-level stand-in (``model.tokenizer=byte``), as the reference loops
    read them."""
    model = args.model + ("_tiny" if args.tiny else "")
    precision = getattr(args, "precision", "bf16")
    return [f"model={model}", f"train.precision={precision}", f"train.micro_batch_size={args.batch}",
            f"train.global_batch_size={args.batch * world}", f"data.path={root}",
            f"data.num_workers={args.workers}", "model.tokenizer=byte",
            *model_overrides(args.overrides)]  # fmt: skip


def run_longboat_variant(
    name: str, args: Any, root: Path, acc: Any, *, world: int = 1, probe: Any = None
) -> dict[str, Any]:
    """``build_training`` + ``Trainer`` with the variant's keys (``bench_train``)."""

    def described(training: Any) -> dict[str, Any]:
        return {"params": dict(training.counts), **(probe(training) if probe else {})}

    out = args.profile_dir and args.profile_dir / f"vla_profile_{args.model}_{name}.txt"
    ov = [*longboat_overrides(args, root, world), *VARIANTS[name]]
    return train_timed("embodied", EXPERIMENT[args.model], ov, acc, warmup=args.warmup,
                       steps=args.steps, profile_steps=args.profile_steps, profile_out=out,
                       profile_parts=PROFILE_PARTS.get(args.model, ()), probe=described)  # fmt: skip


def forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def run_reference(args: Any, cfg: Any, roots: list[Path], acc: Any) -> dict[str, Any]:
    """The reference's own loop (``baselines/``) on the dataset's embodiment roots."""
    device = acc.device()
    leftover = env.free_memory(acc)
    torch.manual_seed(args.seed)
    if args.model == "pi05":
        shapes = pi05_ref.RefShapes.from_pi05_config(cfg)
        model = pi05_ref.build_reference(shapes, device, precision="bfloat16")
        counts = pi05_ref.parameter_counts(model)
        opt = pi05_ref.build_optimizer(model)
        dataset = pi05_data.Pi05ReferenceDataset(roots, shapes)
        loader = pi05_data.build_loader(dataset, args.batch, args.workers, seed=args.seed)

        def step(b: dict, i: int) -> float:
            return pi05_ref.train_step(model, opt, pi05_ref.to_device(b, device), i)
    else:
        shapes = groot_ref.RefShapes.from_groot_config(cfg)
        model = groot_ref.build_reference(shapes, device)
        counts = {k: n for k, n in pi05_ref.parameter_counts(model).items() if k != "total"}
        opt = groot_ref.build_optimizer(model, acc.device_type)
        dataset = groot_data.ReferenceLeRobotDataset(roots, shapes)
        loader = groot_data.build_loader(dataset, args.batch, args.workers, seed=args.seed)

        def step(b: dict, i: int) -> float:
            return groot_ref.train_step(model, opt, groot_ref.to_device(b, device), acc.device_type)

    batches = forever(loader)
    timing, losses = time_loop(acc, batches, step, args.warmup, args.steps)
    out = args.profile_dir and args.profile_dir / f"vla_profile_{args.model}_reference.txt"
    summary = profile_steps(acc, lambda i: step(next(batches), i), args.profile_steps, out)
    peak = acc.memory_stats().get("peak_allocated_gb", 0.0)
    batches.close()  # the loader's workers stop before the next run
    del loader
    return {"timing": timing, "losses": losses, "peak_mem_gb": peak, "params": counts,
            "items_per_step": args.batch, "allocated_at_start_gb": leftover,
            "notes": {"profile": summary} if summary else {}}  # fmt: skip


def entry(name: str, model: str, r: dict[str, Any], flops: float) -> dict[str, Any]:
    """A result row: samples/s over the window's wall clock, the rest from ``Timing``."""
    timing = r.pop("timing")
    s = timing.summary(r["items_per_step"])
    sps = s.pop("window_items_per_s")
    losses = r["losses"]
    if not all(x == x for x in losses):
        raise FloatingPointError(f"non-finite loss in {losses}")
    wait = sum(timing.data_wait) / max(timing.window_s, 1e-12)
    return {"name": name, "model": model, "samples_per_s": sps,
            "median_samples_per_s": s.pop("items_per_s"), "mfu": sps * flops / env.PEAK_BF16_FLOPS,
            "data_wait_fraction": wait, **s, **r}  # fmt: skip


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    base = next((r for r in runs if r["name"] == "reference" and "samples_per_s" in r), None)
    header = ["run", "samples/s", "vs reference", "median step (s)", "data wait (s)",
              "host step (s)", "data-wait share", "MFU", "peak mem (GB)", "final loss"]  # fmt: skip
    rows = []
    for r in runs:
        if "samples_per_s" not in r:
            rows.append(failed_row(r, len(header)))
            continue
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        rows.append([r["name"], fmt(r["samples_per_s"], ".1f"), ratio, fmt(r["median_step_s"]),
                     fmt(r["data_wait_s"]), fmt(r["host_step_s"]),
                     fmt(r["data_wait_fraction"], ".0%"), fmt(r["mfu"], ".1%"),
                     fmt(r["peak_mem_gb"], ".1f"), fmt(r["losses"][-1], ".4f")])  # fmt: skip
    return md_table(header, rows)


def plot(result: dict[str, Any]) -> Any:
    runs = [r for r in result["runs"] if "samples_per_s" in r]
    cfg = result["config"]
    title = (f"vla_throughput {result['date']} {result['gpu']}: {cfg['model']} {cfg['flavor']}, "
             f"batch {cfg['batch']}")  # fmt: skip
    names = [r["name"] for r in runs]
    return lambda plt: runs and env.bar_chart(plt, title, names, [
        ([r["samples_per_s"] for r in runs], "samples/s (end to end)"),
        ([r["median_step_s"] for r in runs], "median device step (s)"),
        ([r["host_step_s"] for r in runs], "median host step (s)"),
    ])  # fmt: skip


def add_data_args(p: argparse.ArgumentParser) -> None:
    """The dataset and model options vla_throughput, vla_scaling and vla_loss_alignment share."""
    p.add_argument("--tiny", action="store_true", help="tiny flavour (CPU smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--embodiments", type=int, default=4)
    p.add_argument("--episodes", type=int, default=12, help="episodes per embodiment")
    p.add_argument("--episode-length", type=int, nargs=2, default=[80, 120])
    p.add_argument("--override", action="append", default=[], metavar="KEY=JSON",
                   help="model config override (both loops), e.g. dit.num_layers=2")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="groot_n1_6", choices=list(EXPERIMENT))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers (both loops)")
    p.add_argument(
        "--runs", default=None, help=f"comma list of reference,lean,{','.join(VARIANTS)}"
    )
    p.add_argument("--profile-steps", type=int, default=0, help="profile N more steps per run")
    p.add_argument("--profile-dir", type=Path, default=None)
    p.add_argument("--results-dir", type=Path, default=env.REPO / "benchmarks/results")
    p.add_argument("--time-budget", type=float, default=0, help="seconds for all runs (0: none)")
    add_data_args(p)
    args = p.parse_args(argv)
    # Untimed until the loader's first burst (every worker's first batch at once) is consumed:
    # timing from a full queue overstates a data-bound loop.
    args.warmup = max(args.warmup, args.workers + 1, 1)
    args.overrides = env.key_values(args.override, "--override")
    from longboat.core.device import get_accelerator
    from longboat.embodied.models import get_config

    acc = get_accelerator()
    on_gpu = acc.device_type != "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    flavor = "tiny" if args.tiny else "full"
    cfg = get_config(args.model, flavor, args.overrides)
    hw = (56, 84) if args.tiny else (256, 256)
    root = dataset_for(args, cfg, hw)
    roots = sorted(d for d in root.iterdir() if d.is_dir())
    flops = flops_per_sample(args.model, cfg, 2, hw)
    default = "reference,longboat,longboat_compiled" if on_gpu else "reference,longboat"
    runs = (args.runs or default).split(",")
    config = {"model": args.model, "flavor": flavor, "experiment": EXPERIMENT[args.model],
              "longboat_overrides": longboat_overrides(args, root), "variants": VARIANTS,
              "model_overrides": args.overrides, "batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "workers": args.workers, "precision": "bf16",
              "image_hw": list(hw), "cameras": 2, "embodiments": args.embodiments,
              "episodes_per_embodiment": args.episodes, "episode_length": args.episode_length,
              "layout": "v2.1", "flops_per_sample": flops, "peak_flops": env.PEAK_BF16_FLOPS}  # fmt: skip
    if args.model == "pi05":  # the dataset's 2 cameras + 1 masked slot
        config["model_cameras"] = cfg.num_cameras
    result = env.result_meta("vla_throughput", on_gpu, PEERS, config)
    tag = ("_pi05" if args.model == "pi05" else "") + ("_tiny" if args.tiny else "")
    stem = f"vla_throughput_{result['date']}{tag}"

    def run_one(name: str) -> dict[str, Any]:
        if name == "reference":
            return entry(name, args.model, run_reference(args, cfg, roots, acc), flops)
        if name == "lean":
            r = vla_lean.run_lean(args.model, flavor, args.overrides, batch=args.batch,
                                  image_hw=hw, text_len=TEXT_LEN, acc=acc, warmup=args.warmup,
                                  steps=args.steps, seed=args.seed)  # fmt: skip
            return entry(name, args.model, r, flops)
        if name not in VARIANTS:
            raise ValueError(
                f"unknown run {name!r}: use reference, lean or one of {list(VARIANTS)}"
            )
        return entry(name, args.model, run_longboat_variant(name, args, root, acc), flops)

    def write() -> None:
        env.write_results(result, out=args.out, results_dir=args.results_dir, stem=stem,
                      table=table(result), plot=plot(result), note=f"config: {config}")  # fmt: skip

    say = lambda r: f"{r['samples_per_s']:.1f} samples/s, peak {r['peak_mem_gb']:.1f} GB"  # noqa: E731
    env.run_all(runs, run_one, result, write, time_budget=args.time_budget, describe=say)
    write()
    print(f"\nvla_throughput {result['date']} {result['gpu']} commit {result['commit']} "
          f"({flavor}, batch {args.batch}, {args.workers} workers)")  # fmt: skip
    print(table(result))
    return 0 if all("samples_per_s" in r for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
