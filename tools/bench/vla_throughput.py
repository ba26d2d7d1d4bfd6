"""VLA training throughput: the reference GR00T-N1.6 (or pi0.5) loop vs longboat-embodied, one run.

    python tools/bench/vla_throughput.py --out results.json [--model groot_n1_6|pi05] [--batch 32]
        [--steps 20] [--warmup 5] [--workers 8] [--tiny] [--results-dir benchmarks/results]

Both loops train the same model shapes (``longboat.embodied`` config ``full`` or ``tiny``)
on the same synthetic LeRobot v2.1 dataset (written with the data engineer's
``write_synthetic_dataset``: several embodiments, many episodes, 2 cameras at 256x256 for
``full``), from random init, bf16, same batch size and loader worker count:

- ``reference``: ``tools/bench/baselines/groot_n1_6_reference.py`` (transformers modules,
  whole-episode decode + PIL + processor in DataLoader workers, eager, HF-Trainer step).
- ``longboat``: the embodied trainer's pieces (``open_dataset`` + ``PolicyCollator`` +
  ``RankMicroBatches``, ``build_model`` + ``apply_freezing`` + ``parallelize`` +
  ``build_optimizer`` + ``train_step``): frame-accurate decode of needed frames only,
  image preprocessing on the device, truncated LM without head, frozen parts bf16, kernels
  through ``longboat.kernels``; the loader additionally pins memory.
- ``longboat_compiled`` (``--compile``, default on accelerators): the same with every
  ``parallel_blocks()`` block ``torch.compile``d.

``--model pi05``: the reference is ``tools/bench/baselines/pi05_reference.py`` (openpi's
PyTorch training as users run it: transformers SigLIP + Gemma modules, bf16 weights with fp32
norms, gradient checkpointing on, eager attention with a materialised 4D mask, prompt padded
to ``max_token_len``, on-device augmentation, AdamW (0.9, 0.95), per-sample decode + PIL
resize-with-pad + tokenisation in DataLoader workers); the longboat runs train ``pi05`` with
the same optimizer settings (lr 2.5e-5, betas (0.9, 0.95), weight decay 1e-10, clip 1.0) on
3 cameras (the dataset's 2 plus one masked, as the reference). The reference pads every prompt
to ``max_token_len`` (200: a 968-token prefix) as openpi does, longboat pads text to the
batch's longest (~800-token prefix at full shapes); ``--override max_token_len=64`` shrinks the
reference's padding to measure how much of the ratio it accounts for. The two loops' losses
are not comparable here: openpi averages over every padded action dim, longboat masks them.

Per run: samples/s over the timed window's wall clock (data loading included), the median
step time on the device (steps run back to back as in a training loop, timed by device
events between them: ``bench_timing.StepClock``; a loop that reads its loss every step, as
the reference's HF-Trainer-style ``loss.item()`` does, pays that sync inside its step), the
host's median wait for a batch and its median time to enqueue a step (when that reaches the
device step time, the loop is host bound), peak device memory (accelerator API), MFU from an
analytic FLOP count of the useful work (the reference's discarded LM head not counted)
against 989 TFLOP/s. ``--sync-every-step`` restores the older method (device synchronize
after every step).
Writes ``<results-dir>/vla_throughput_<date>.{json,md,png}`` and ``--out``; prints the table
last. ``--tiny`` runs the tiny flavour (CPU smoke).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import signal
import statistics
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
for sub in ("packages/core/src", "packages/kernels/src", "packages/embodied/src"):
    if str(REPO / sub) not in sys.path:
        sys.path.insert(0, str(REPO / sub))
sys.path.insert(0, str(Path(__file__).resolve().parent / "baselines"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import groot_n1_6_reference as ref  # noqa: E402
import groot_n1_6_reference_data as ref_data  # noqa: E402
import pi05_reference as pi05_ref  # noqa: E402
import pi05_reference_data as pi05_ref_data  # noqa: E402
from bench_env import git_commit, gpu_name, key_values, pyplot, versions  # noqa: E402
from bench_profile import profile_steps  # noqa: E402
from bench_timing import StepClock  # noqa: E402

from longboat.core.device import get_accelerator  # noqa: E402

PEAK_BF16_FLOPS = 989e12
DATE = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")


# ----------------------------------------------------------------------------- dataset


def _write_one_embodiment(job: tuple[str, int, int, int, int, int, int, tuple[int, int]]) -> str:
    """Worker: write one embodiment's v2.1 dataset, then stamp its embodiment id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import longboat.embodied.data.synthetic as syn
    from longboat.embodied.data.stats import image_stats

    root, emb, episodes, lo, hi, sdim, adim, hw = job
    # Image stats (quantiles over every pixel) cost more than the encode and neither loop
    # reads them: compute them on a subsample.
    syn.image_stats = lambda frames: image_stats(frames[::10, ::8, ::8])
    spec = syn.EmbodimentSpec(name=f"robot{emb}", state_dim=sdim, action_dim=adim)
    syn.write_synthetic_dataset(
        root,
        layout="v2.1",
        num_episodes=episodes,
        episode_length=(lo, hi),
        image_size=hw,
        embodiments=(spec,),
        seed=emb,
    )
    for path in sorted(Path(root, "data").rglob("*.parquet")):
        table = pq.read_table(path)
        col = table.schema.get_field_index("embodiment_id")
        ids = pa.array([emb] * table.num_rows, type=pa.int64())
        pq.write_table(table.set_column(col, "embodiment_id", ids), path)
    return root


def make_dataset(
    root: Path,
    *,
    embodiments: int,
    episodes: int,
    length: tuple[int, int],
    hw: tuple[int, int],
    max_state: int,
    max_action: int,
) -> list[Path]:
    """Write (once) ``embodiments`` LeRobot v2.1 datasets under ``root``, in parallel."""
    roots = [root / f"robot{e}" for e in range(embodiments)]
    done = root / ".complete"
    if done.exists():
        return roots
    jobs = [
        (
            str(r),
            e,
            episodes,
            length[0],
            length[1],
            min(max_state, 6 + 2 * e),
            min(max_action, 5 + 2 * e),
            hw,
        )
        for e, r in enumerate(roots)
    ]
    with ProcessPoolExecutor(max_workers=min(embodiments, os.cpu_count() or 1)) as pool:
        list(pool.map(_write_one_embodiment, jobs))
    done.write_text("ok\n")
    return roots


# ----------------------------------------------------------------------------- FLOPs


def flops_per_sample(cfg: Any, n_cams: int, image_hw: tuple[int, int], text_len: int) -> float:
    """Useful training FLOPs of one GR00T N1.6 sample (matmuls + attention; fwd, and bwd
    where gradients flow: the top LM layers and the action head)."""
    v, lm, dit = cfg.vision, cfg.llm, cfg.dit
    oh, ow = cfg.image.output_size(*image_hw)
    t_img = (oh // v.patch_size) * (ow // v.patch_size)
    d = v.hidden_size
    vit_layer = 2 * t_img * (4 * d * d + 2 * d * v.intermediate_size) + 4 * t_img * t_img * d
    vit = n_cams * v.num_layers * vit_layer
    t_tok = t_img // cfg.pixel_unshuffle**2
    proj = n_cams * 2 * t_tok * (4 * d * lm.hidden_size + lm.hidden_size**2)
    seq = n_cams * t_tok + text_len
    h = lm.hidden_size
    attn_w = h * lm.num_heads * lm.head_dim * 2 + h * lm.num_kv_heads * lm.head_dim * 2
    lm_layer = (
        2 * seq * (attn_w + 3 * h * lm.intermediate_size)
        + 4 * seq * seq * lm.num_heads * lm.head_dim
    )
    lm_fwd = cfg.select_layer * lm_layer
    lm_bwd = 2 * cfg.tune_top_llm_layers * lm_layer
    inner, t = dit.inner_dim, cfg.action_horizon + 1
    dit_fwd = 0.0
    for i in range(dit.num_layers):
        ctx = seq if i % 2 == 0 else t
        kv_in = dit.cross_attention_dim if i % 2 == 0 else inner
        dit_fwd += 2 * t * 2 * inner * inner + 2 * ctx * 2 * kv_in * inner
        dit_fwd += 4 * t * ctx * inner + 2 * t * 2 * inner * dit.ff_mult * inner
    a = cfg.max_action_dim
    enc = 2 * cfg.action_horizon * (a * inner + 2 * inner * inner + inner * inner)
    dec = 2 * t * (dit.output_dim * cfg.action_decoder_hidden + cfg.action_decoder_hidden * a)
    head = 3 * (dit_fwd + enc + dec)
    return float(vit + proj + lm_fwd + lm_bwd + head)


def flops_per_sample_pi05(cfg: Any, text_len: int) -> float:
    """Useful training FLOPs of one pi0.5 sample (matmuls + attention, fwd + bwd = 3x fwd;
    everything trains): ViT on every camera slot, projector, the joint LM + expert layers
    over longboat's prefix (images + text + state tokens) and the action suffix, the last LM
    layer's prefix queries / output / MLP not counted (their output is never read), nor the
    reference's padding of the prompt to ``max_token_len``."""
    v, lm, ex = cfg.vision, cfg.llm, cfg.expert
    side = cfg.image.pad_to_square
    t_img = (side // v.patch_size) ** 2
    d = v.hidden_size
    vit_layer = 2 * t_img * (4 * d * d + 2 * d * v.intermediate_size) + 4 * t_img * t_img * d
    n_cams = cfg.num_cameras
    vit = n_cams * (v.num_layers * vit_layer + 2 * t_img * d * lm.hidden_size)
    p = n_cams * t_img + text_len + cfg.max_state_dim
    s = cfg.action_horizon
    hd, nh, nkv = lm.head_dim, lm.num_heads, lm.num_kv_heads

    def proj(width: int, mlp: int, tokens: int, with_q_out: bool = True) -> float:
        qo = 2 * width * nh * hd if with_q_out else 0
        mlp_f = 3 * width * mlp if with_q_out else 0
        return 2 * tokens * (qo + 2 * width * nkv * hd + mlp_f)

    layers = 0.0
    for i in range(lm.num_layers):
        last = i == lm.num_layers - 1
        layers += proj(lm.hidden_size, lm.intermediate_size, p, with_q_out=not last)
        layers += proj(ex.hidden_size, ex.intermediate_size, s)
        q_rows = s + (0 if last else p)
        layers += 4 * q_rows * (p + s) * nh * hd
        layers += 2 * s * 3 * ex.hidden_size * ex.hidden_size * 2  # adaRMS modulations
    a, we = cfg.action_dim, ex.hidden_size
    head = 2 * s * (2 * a * we) + 2 * 2 * we * we
    return float(3 * (vit + layers + head))


# ----------------------------------------------------------------------------- timing


class Timer:
    """Per step: the host's wait for the batch and its time to enqueue the step (host
    clock), and the step's device time (``StepClock``: gaps between device events; steps
    run back to back, with no device sync between them beyond what a loop does itself)."""

    def __init__(self, acc: Any, *, sync_every_step: bool = False) -> None:
        self.clock = StepClock(acc, sync_every_step=sync_every_step)
        self.data: list[float] = []
        self.host: list[float] = []
        self.losses: list[Any] = []  # device tensors or floats until the window ends
        self.device: list[float] = []

    def summary(self, batch: int, warmup: int, flops: float, wall: float) -> dict[str, Any]:
        d, h, steps = self.data[warmup:], self.host[warmup:], self.device
        sps = batch * len(steps) / wall
        med = statistics.median(steps)
        return {
            "samples_per_s": sps,
            "median_step_s": med,
            "median_samples_per_s": batch / med,
            "data_wait_s": statistics.median(d),
            "host_step_s": statistics.median(h),
            "data_wait_fraction": sum(d) / max(wall, 1e-12),
            "mfu": sps * flops / PEAK_BF16_FLOPS,
            "timed_steps": len(steps),
            "warmup_steps": warmup,
            "timing": self.clock.method,
            "losses": self.losses,
        }


def _loop(
    acc: Any,
    it: Any,
    step_fn: Any,
    to_dev: Any,
    steps: int,
    warmup: int,
    deadline: float,
    sync_every_step: bool = False,
) -> tuple[Timer, float]:
    """``step_fn(batch, i)`` returns the step's loss (a float, or a device tensor read after
    the window: a loop that reads it every step pays that sync inside its own step)."""
    timer = Timer(acc, sync_every_step=sync_every_step)
    clock = timer.clock
    for i in range(warmup + steps):
        if i == warmup:
            clock.start()
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        if i >= warmup:
            clock.before_step()
        loss = step_fn(to_dev(batch), i)
        if i >= warmup:
            clock.mark()
        timer.data.append(t1 - t0)
        timer.host.append(time.perf_counter() - t1)
        timer.losses.append(loss)
        if time.perf_counter() > deadline and i >= warmup + 2:
            print(f"  time budget reached after {i + 1 - warmup} timed steps", flush=True)
            break
    wall = clock.stop() if len(timer.data) > warmup else 0.0
    timer.device = clock.step_times() if wall else []
    timer.losses = [float(x) for x in timer.losses]
    for i, loss in enumerate(timer.losses):
        if not (loss == loss):  # NaN
            raise FloatingPointError(f"non-finite loss {loss} at step {i}")
    return timer, wall


def _profile(
    acc: Any, it: Any, step_fn: Any, to_dev: Any, steps: int, out: Path | None, first: int
) -> dict[str, Any] | None:
    """Run ``steps`` more steps under torch.profiler (bench_profile): op table + summary."""
    return profile_steps(
        acc, lambda i: step_fn(to_dev(next(it)), first + i), steps, out, title=str(out)
    )


class _Alarm:
    """Raise ``TimeoutError`` in the main thread after ``seconds`` (a run that overruns the
    whole budget, e.g. a long torch.compile, fails alone and the table is still printed)."""

    def __init__(self, seconds: float) -> None:
        self.armed = hasattr(signal, "SIGALRM") and seconds < 1e8
        if self.armed:
            signal.signal(signal.SIGALRM, self._fire)
            signal.alarm(max(1, int(seconds)))

    @staticmethod
    def _fire(signum: int, frame: Any) -> None:
        raise TimeoutError("run exceeded the benchmark's --time-budget")

    def cancel(self) -> None:
        if self.armed:
            signal.alarm(0)


def _free(acc: Any) -> None:
    gc.collect()
    acc.empty_cache()
    acc.reset_peak_memory_stats()


def run_reference_pi05(
    acc: Any, cfg: Any, roots: list[Path], args: argparse.Namespace, deadline: float
) -> tuple[Timer, float, dict[str, int]]:
    """openpi's PyTorch loop for pi0.5 (``baselines/pi05_reference.py``)."""
    device = acc.device()
    shapes = pi05_ref.RefShapes.from_pi05_config(cfg)
    torch.manual_seed(args.seed)
    model = pi05_ref.build_reference(shapes, device, precision="bfloat16")
    counts = pi05_ref.parameter_counts(model)
    opt = pi05_ref.build_optimizer(model)
    dataset = pi05_ref_data.Pi05ReferenceDataset(roots, shapes)
    loader = pi05_ref_data.build_loader(dataset, args.batch, args.workers, seed=args.seed)
    it = iter(loader)

    def step(b: dict, i: int) -> float:
        return pi05_ref.train_step(model, opt, b, i)

    try:
        timer, wall = _loop(
            acc, it, step, lambda b: pi05_ref.to_device(b, device), args.steps, args.warmup,
            deadline, args.sync_every_step,
        )  # fmt: skip
        _profile(
            acc,
            it,
            step,
            lambda b: pi05_ref.to_device(b, device),
            args.profile_steps,
            args.profile_dir and args.profile_dir / "vla_profile_pi05_reference.txt",
            args.warmup + args.steps,
        )
    finally:
        del it, loader
    return timer, wall, counts


def run_reference(
    acc: Any, cfg: Any, roots: list[Path], args: argparse.Namespace, deadline: float
) -> tuple[Timer, float, dict[str, int]]:
    """The reference loop; returns its timer, timed wall time and parameter counts."""
    if args.model == "pi05":
        return run_reference_pi05(acc, cfg, roots, args, deadline)
    device = acc.device()
    shapes = ref.RefShapes.from_groot_config(cfg)
    torch.manual_seed(args.seed)
    model = ref.build_reference(shapes, device)
    counts = {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        counts["trainable" if p.requires_grad else "frozen"] += p.numel()
    opt = ref.build_optimizer(model, acc.device_type)
    dataset = ref_data.ReferenceLeRobotDataset(roots, shapes)
    loader = ref_data.build_loader(dataset, args.batch, args.workers, seed=args.seed)
    it = iter(loader)
    try:
        timer, wall = _loop(
            acc,
            it,
            lambda b, i: ref.train_step(model, opt, b, acc.device_type, bf16=True),
            lambda b: ref.to_device(b, device),
            args.steps,
            args.warmup,
            deadline,
            args.sync_every_step,
        )
        _profile(
            acc,
            it,
            lambda b, i: ref.train_step(model, opt, b, acc.device_type, bf16=True),
            lambda b: ref.to_device(b, device),
            args.profile_steps,
            args.profile_dir and args.profile_dir / "vla_profile_reference.txt",
            args.warmup + args.steps,
        )
    finally:
        del it, loader
    return timer, wall, counts


# What each longboat run sets (the trainer's keys): master weights, their storage, the one-pass
# Triton AdamW (train.master_weight_update=kernel), a CUDA graph, torch.compile of the blocks.
LONGBOAT_VARIANTS: dict[str, dict[str, Any]] = {
    "longboat": {},
    "longboat_compiled": {"compile": True},
    "longboat_master": {"master": "split"},
    "longboat_graphed": {"master": "split", "graphed": True},
    "longboat_graphed_fp32master": {"master": "fp32", "graphed": True},
    "longboat_graphed_kernel": {"master": "split", "graphed": True, "kernel": True},
}
LONGBOAT_RUNS = tuple(LONGBOAT_VARIANTS)


def run_longboat(
    acc: Any,
    cfg: Any,
    root: Path,
    args: argparse.Namespace,
    deadline: float,
    variant: str,
    *,
    rank: int = 0,
    world_size: int = 1,
    micro_batches: Any = None,
    prepare: Any = None,
    keep: dict[str, Any] | None = None,
) -> tuple[Timer, float, dict[str, int]]:
    """The longboat-embodied trainer's model, input pipeline and step loop.

    ``variant`` (``LONGBOAT_VARIANTS``): ``longboat`` (fp32 trainable weights + bf16
    autocast, the reference's layout), ``longboat_master`` (``train.master_weights``: bf16
    weights as views of one flat buffer, master weights in the optimizer in the default
    ``split`` storage, no per-use weight casts), ``longboat_graphed`` (``train.cuda_graph``:
    ``longboat_master`` with the whole step - forward, backward, clip, update - replayed as
    one CUDA graph; text padded to the fixed maximum so every batch has the same shapes),
    ``longboat_graphed_fp32master`` (its masters in fp32 storage), ``longboat_graphed_kernel``
    (the one-pass Triton AdamW, ``train.master_weight_update=kernel``), ``longboat_compiled``
    (``longboat`` with every parallel block torch.compile'd). The master-weight runs step as
    the trainer does: ``run_step`` with the NaN guard resolved one step late
    (``LaggedGuard``) and the LR schedule on the device, no per-step host sync.

    ``rank`` / ``world_size``: data-parallel rank of a multi-process run (its process group
    initialised; vla_scaling.py); ``micro_batches``: the ``RankMicroBatches`` class to use;
    ``prepare(batch)``: applied to each host batch before it goes to the device; ``keep``:
    receives the ``optimizer``."""
    spec = LONGBOAT_VARIANTS[variant]
    graphed = bool(spec.get("graphed"))
    master = spec.get("master")
    from torch.utils.data import DataLoader

    from longboat.core.config.schema import LRScheduleConfig, NaNGuardConfig, OptimConfig
    from longboat.core.loop import NaNGuard, build_lr_scheduler
    from longboat.embodied.config import LeRobotDataConfig
    from longboat.embodied.models import apply_freezing, build_model
    from longboat.embodied.parallel import ParallelSetup, build_optimizer, parallelize
    from longboat.embodied.train.datasets import open_dataset
    from longboat.embodied.train.loader import RankMicroBatches
    from longboat.embodied.train.plan import BatchLayout, GlobalBatchPlan
    from longboat.embodied.train.policy_batch import PolicyCollator, batch_spec, to_device
    from longboat.embodied.train.step import GraphableStep, LaggedGuard, run_step, train_step

    device = acc.device()
    data_cfg = LeRobotDataConfig(path=str(root), video_backend="pyav")
    dataset, cams, hw = open_dataset(data_cfg, root, cfg.action_horizon)
    collate = PolicyCollator(
        batch_spec(args.model, cfg, len(cams), hw), cams, fixed_text_length=graphed
    )
    layout = BatchLayout(args.batch * world_size, args.batch, world_size)
    plan = GlobalBatchPlan(len(dataset), layout, seed=args.seed, shuffle=True)
    micro = (micro_batches or RankMicroBatches)(
        dataset, plan, collate, dp_rank=rank, seed=args.seed
    )
    total = args.warmup + args.steps + args.profile_steps
    loader = DataLoader(
        micro,
        batch_size=None,
        sampler=range(total),
        num_workers=args.workers,
        pin_memory=acc.device_type != "cpu",
        prefetch_factor=2 if args.workers > 0 else None,
    )
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = build_model(args.model, cfg)
    counts = apply_freezing(model, cfg)
    model.train()
    setup = ParallelSetup(
        strategy="ddp", world_size=world_size, rank=rank, device_type=acc.device_type
    )
    device_ids = [device.index or 0] if acc.device_type == "cuda" and world_size > 1 else None
    model = parallelize(
        model, setup, precision="bf16", master_weights=bool(master), device_ids=device_ids
    )
    if args.model == "pi05":  # the reference's (openpi's) AdamW settings
        optim = OptimConfig(lr=2.5e-5, weight_decay=1e-10, betas=[0.9, 0.95], grad_clip=1.0)
    else:
        optim = OptimConfig(lr=1e-4, weight_decay=1e-5, betas=[0.9, 0.999], grad_clip=1.0)
    optim.schedule = LRScheduleConfig(name="constant")
    opt = build_optimizer(
        model, optim, setup, master_weights=bool(master), master_storage=master or "fp32",
        master_update="kernel" if spec.get("kernel") else "slices",
    )  # fmt: skip
    if keep is not None:
        keep["optimizer"] = opt
    if spec.get("compile"):
        for block in model.parallel_blocks():
            block.compile()
    rank_offset = rank  # one micro-batch a step: rank r trains global micro-batch r

    if master:
        fn: Any = GraphableStep(
            model, opt, precision="bf16", device_type=acc.device_type, grad_clip=1.0,
            skip_nonfinite_loss=True,
        )  # fmt: skip
        if graphed:
            from longboat.core.loop import GraphedStep

            fn = GraphedStep(fn, accelerator=acc, warmup=3, name="vla step")
        lagged = LaggedGuard(
            NaNGuard(NaNGuardConfig()), opt, build_lr_scheduler(opt, optim.schedule, total),
            total_steps=total, accelerator=acc,
        )  # fmt: skip

    def step(batch: dict, i: int) -> Any:
        if master:
            out = run_step(
                fn, opt, batch, step=i, seed=args.seed, rank_offset=rank_offset,
                device_type=acc.device_type, device_index=device.index or 0, lagged=lagged,
            )  # fmt: skip
            return out.loss  # read after the timed window (the product loop logs every N)
        out = train_step(
            model,
            opt,
            [batch],
            step=i,
            seed=args.seed,
            rank_offset=rank_offset,
            device_type=acc.device_type,
            precision="bf16",
            grad_clip=1.0,
            host_sync=True,
        )
        return out.loss

    def to_dev(b: dict) -> dict:
        return to_device(prepare(b) if prepare else b, device)

    it = iter(loader)
    try:
        timer, wall = _loop(
            acc, it, step, to_dev, args.steps, args.warmup, deadline, args.sync_every_step
        )
        name = variant if args.model == "groot_n1_6" else f"{args.model}_{variant}"
        _profile(
            acc,
            it,
            step,
            to_dev,
            args.profile_steps,
            args.profile_dir and args.profile_dir / f"vla_profile_{name}.txt",
            args.warmup + args.steps,
        )
        if master:
            lagged.flush()  # the last verdicts (and a NaN abort) before the results
    finally:
        del it, loader
    return timer, wall, counts


# ----------------------------------------------------------------------------- reporting


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    base = next((r for r in runs if r["name"] == "reference" and "samples_per_s" in r), None)
    lines = [
        "| run | samples/s | vs reference | median step (s) | data wait (s) | host step (s) "
        "| data-wait share | MFU | peak mem (GB) | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if "samples_per_s" not in r:
            lines.append(f"| {r['name']} | failed: {r.get('error', '?')[:80]} | | | | | | | | |")
            continue
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['name']} | {r['samples_per_s']:.1f} | {ratio} | {r['median_step_s']:.3f} | "
            f"{r['data_wait_s']:.3f} | {r.get('host_step_s', r.get('compute_s', 0.0)):.3f} | "
            f"{r['data_wait_fraction']:.0%} | "
            f"{r['mfu']:.1%} | {r['peak_mem_gb']:.1f} | {r['losses'][-1]:.4f} |"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = [r for r in result["runs"] if "samples_per_s" in r]
    if not runs:
        return
    names = [r["name"] for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.bar(names, [r["samples_per_s"] for r in runs], color="tab:blue")
    a1.set_ylabel("samples/s (end to end)")
    title = {"groot_n1_6": "GR00T-N1.6", "pi05": "pi0.5"}.get(result["config"]["model"], "VLA")
    a1.set_title(f"{title} {result['config']['flavor']}, batch {result['config']['batch']}")
    x = list(range(len(runs)))
    width = 0.27
    for k, (key, label, color) in enumerate(
        (
            ("median_step_s", "device step", "tab:green"),
            ("host_step_s", "host: enqueue step", "tab:purple"),
            ("data_wait_s", "host: wait for batch", "tab:orange"),
        )
    ):
        a2.bar([v + (k - 1) * width for v in x], [r.get(key, 0.0) for r in runs], width,
               label=label, color=color)  # fmt: skip
    a2.set_xticks(x, names)
    a2.set_ylabel("median seconds per step")
    a2.legend()
    fig.suptitle(f"vla_throughput {result['date']} {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="groot_n1_6", choices=["groot_n1_6", "pi05"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers (both loops)")
    p.add_argument("--tiny", action="store_true", help="tiny flavour (CPU smoke)")
    p.add_argument(
        "--runs",
        default=None,
        help="comma list of reference,longboat,longboat_master,longboat_compiled",
    )
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument(
        "--profile-steps", type=int, default=0, help="profile N more steps per run (torch.profiler)"
    )
    p.add_argument("--profile-dir", type=Path, default=None, help="where the profile tables go")
    p.add_argument("--embodiments", type=int, default=4)
    p.add_argument("--episodes", type=int, default=12, help="episodes per embodiment")
    p.add_argument("--episode-length", type=int, nargs=2, default=[80, 120])
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks/results")
    p.add_argument("--time-budget", type=float, default=1e9, help="seconds for the whole run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sync-every-step",
        action="store_true",
        help="synchronize after every timed step (the method of results before 2026-11-30) "
        "instead of timing back-to-back steps with device events",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        help="model config override KEY=JSON_VALUE (repeatable), e.g. dit.num_layers=2",
    )
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    if args.workers > 0:
        # Untimed until the loader's first burst (every worker finishing its first batch at
        # once) is consumed: timing from a full queue overstates a data-bound loop.
        args.warmup = max(args.warmup, args.workers + 1)

    from longboat.embodied.models import get_config

    acc = get_accelerator()
    on_gpu = acc.device_type != "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    flavor = "tiny" if args.tiny else "full"
    overrides = key_values(args.override, "--override")
    cfg = get_config(args.model, flavor, overrides)
    hw = (56, 84) if args.tiny else (256, 256)
    runs = (
        args.runs or ("reference,longboat,longboat_compiled" if on_gpu else "reference,longboat")
    ).split(",")

    data_dir = args.data_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"vla_bench_{flavor}"
    t0 = time.perf_counter()
    roots = make_dataset(
        data_dir,
        embodiments=args.embodiments,
        episodes=args.episodes,
        length=tuple(args.episode_length),
        hw=hw,
        max_state=cfg.max_state_dim,
        max_action=cfg.max_action_dim if args.model == "groot_n1_6" else cfg.action_dim,
    )
    print(f"dataset: {data_dir} ({time.perf_counter() - t0:.1f}s)", flush=True)
    n_cams = 2
    if args.model == "pi05":
        flops = flops_per_sample_pi05(cfg, text_len=24)
    else:
        flops = flops_per_sample(cfg, n_cams, hw, text_len=24)
    result: dict[str, Any] = {
        "benchmark": "vla_throughput",
        "date": DATE,
        "gpu": gpu_name() if on_gpu else "cpu",
        "versions": versions("transformers", "av", "triton"),
        "commit": git_commit(),
        "config": {
            "model": args.model,
            "flavor": flavor,
            "overrides": overrides,
            "batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "workers": args.workers,
            "precision": "bf16",
            "image_hw": list(hw),
            "cameras": n_cams,
            "embodiments": args.embodiments,
            "episodes_per_embodiment": args.episodes,
            "episode_length": args.episode_length,
            "layout": "v2.1",
            "flops_per_sample": flops,
            "peak_flops": PEAK_BF16_FLOPS,
        },
        "runs": [],
    }
    if args.model == "pi05":  # the dataset's 2 cameras + 1 masked slot
        result["config"]["model_cameras"] = cfg.num_cameras
    deadline_all = t_start + args.time_budget
    for name in runs:
        remaining = deadline_all - time.perf_counter()
        if remaining < 30:
            result["runs"].append(
                {"name": name, "model": args.model, "error": "skipped: time budget"}
            )
            continue
        print(f"run {name} ...", flush=True)
        _free(acc)
        entry: dict[str, Any] = {"name": name, "model": args.model}
        alarm = _Alarm(remaining)
        try:
            # Leave each later run a share of the budget.
            share = 1.0 if name == runs[-1] else 0.35
            deadline = time.perf_counter() + remaining * share
            if name == "reference":
                timer, wall, counts = run_reference(acc, cfg, roots, args, deadline)
            else:
                if name not in LONGBOAT_RUNS:
                    raise ValueError(f"unknown run {name!r}: use reference or {LONGBOAT_RUNS}")
                timer, wall, counts = run_longboat(acc, cfg, data_dir, args, deadline, name)
            entry.update(timer.summary(args.batch, args.warmup, flops, wall))
            entry["peak_mem_gb"] = acc.memory_stats()["peak_allocated_gb"]
            entry["params"] = counts
            entry["warmup_s"] = sum(timer.data[: args.warmup]) + sum(timer.host[: args.warmup])
        except Exception as exc:
            traceback.print_exc()
            entry["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            alarm.cancel()
        result["runs"].append(entry)
        print(f"  {json.dumps({k: v for k, v in entry.items() if k != 'losses'})}", flush=True)
        _write(result, args)
    _write(result, args)
    print(
        f"\nvla_throughput {result['date']} {result['gpu']} torch {torch.__version__} "
        f"commit {result['commit']} ({flavor}, batch {args.batch}, {args.workers} workers)"
    )
    print(table(result))
    ok = all("samples_per_s" in r for r in result["runs"])
    return 0 if ok else 1


def _write(result: dict[str, Any], args: argparse.Namespace) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / f"vla_throughput_{result['date']}"
    if result["config"]["model"] != "groot_n1_6":
        stem = stem.with_name(f"{stem.name}_{result['config']['model']}")
    if args.tiny:
        stem = stem.with_name(stem.name + "_tiny")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    header = (
        f"# vla_throughput {result['date']}\n\n{result['gpu']}, "
        f"{', '.join(f'{k} {v}' for k, v in result['versions'].items())}, commit "
        f"{result['commit']}\n\nconfig: {json.dumps(result['config'])}\n\n"
    )
    stem.with_suffix(".md").write_text(header + table(result) + "\n")
    plot(result, stem.with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())
