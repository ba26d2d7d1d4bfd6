"""VLA loss alignment: the reference GR00T-N1.6 loop vs longboat from the same initial weights,
the same batches and the same flow-matching draws.

    python tools/bench/vla_loss_alignment.py --out results.json [--steps 200] [--batch 8]
        [--tiny] [--model groot_n1_6|pi05] [--results-dir benchmarks/results]

longboat's ``groot_n1_6`` is built (fp32, seed), its weights are copied into the reference
model (``transfer_weights``: the ViT's fused qkv split into q/k/v, the conv patch embedding
as Siglip2's linear over (p, p, 3) patches, the projector's input channels permuted from
``F.pixel_unshuffle`` order to Eagle's ``pixel_shuffle`` order), then both freeze (frozen
bf16, trainable fp32) and train with bf16 autocast, AdamW 1e-4, clip 1.0 on identical
synthetic batches. Images are fed already normalised to both (the reference as Siglip2
patches, longboat through an identity ``preprocess_images``), flow-matching noise and time
come from the batch, DiT dropout is 0 (dropout masks cannot match across implementations).
Reports the max per-step relative loss difference and both curves (JSON + md + PNG).
The position table must be square (true at full shapes: 18x18); ``--tiny`` overrides the
tiny ViT grid to 4x4 on 56x56 images.

``--model pi05``: longboat's ``pi05`` against ``baselines/pi05_reference.py`` (openpi's
PyTorch loop: bf16 weights with fp32 norms, no autocast, gradient checkpointing, eager
attention; ``--ref-precision float32`` runs it in fp32). ``pi05_reference.transfer_weights``
copies every longboat weight over (the ViT's fused qkv split into q/k/v, the adaRMSNorm
modulations into the expert norms' ``dense``); both train with AdamW (0.9, 0.95), weight decay
1e-10, clip 1.0 at one constant lr (``--lr``, default openpi's peak 2.5e-5) on identical batches:
normalised 224 px (tiny: 56 px) images on 3 cameras (the third masked), fed to longboat through
an identity ``preprocess_images`` and to the reference with its augmentation off; prompt =
text ids + state bins (the reference's padded to ``max_token_len``); noise and time from the
batch; no action mask (openpi's loss is the mean over every padded dim).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
for sub in ("packages/core/src", "packages/kernels/src", "packages/embodied/src"):
    if str(REPO / sub) not in sys.path:
        sys.path.insert(0, str(REPO / sub))
sys.path.insert(0, str(Path(__file__).resolve().parent / "baselines"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import groot_n1_6_reference as ref  # noqa: E402
from bench_env import git_commit, gpu_name, key_values, versions  # noqa: E402
from vla_throughput import DATE  # noqa: E402

from longboat.core.device import get_accelerator  # noqa: E402


def _unshuffle_perm(d: int) -> torch.Tensor:
    """perm[k] = longboat projector channel that Eagle's channel k holds."""
    x = torch.arange(4 * 4 * d, dtype=torch.float64).reshape(1, 16, d)
    lb = F.pixel_unshuffle(x.transpose(1, 2).reshape(1, d, 4, 4), 2).flatten(2).transpose(1, 2)
    ea = ref.eagle_pixel_shuffle(x.reshape(1, 4, 4, d)).reshape(1, -1, 4 * d)
    pos = {float(v): i for i, v in enumerate(lb[0, 0].tolist())}
    return torch.tensor([pos[float(v)] for v in ea[0, 0].tolist()])


@torch.no_grad()
def transfer_weights(lb: Any, rf: Any, cfg: Any) -> None:
    """Copy every weight of longboat's GrootN16 into the reference model (both fp32)."""
    copied: set[str] = set()
    dst = dict(rf.named_parameters())

    def put(name: str, value: torch.Tensor) -> None:
        if name not in dst:
            raise KeyError(f"reference has no parameter {name}")
        if dst[name].shape != value.shape:
            raise ValueError(f"{name}: {tuple(value.shape)} -> {tuple(dst[name].shape)}")
        dst[name].copy_(value)
        copied.add(name)

    v, bb = "backbone.vision_model.", lb.backbone
    put(
        v + "embeddings.patch_embedding.weight",
        bb.vision.patch_embed.weight.permute(0, 2, 3, 1).reshape(cfg.vision.hidden_size, -1),
    )
    put(v + "embeddings.patch_embedding.bias", bb.vision.patch_embed.bias)
    put(v + "embeddings.position_embedding.weight", bb.vision.pos_embed)
    for i, blk in enumerate(bb.vision.blocks):
        p = f"{v}encoder.layers.{i}."
        q, k, vv = blk.qkv.weight.chunk(3, 0)
        qb, kb, vb = blk.qkv.bias.chunk(3, 0)
        for n, w, b in (("q", q, qb), ("k", k, kb), ("v", vv, vb)):
            put(p + f"self_attn.{n}_proj.weight", w)
            put(p + f"self_attn.{n}_proj.bias", b)
        for src, name in (
            (blk.out_proj, "self_attn.out_proj"),
            (blk.layer_norm1, "layer_norm1"),
            (blk.layer_norm2, "layer_norm2"),
            (blk.fc1, "mlp.fc1"),
            (blk.fc2, "mlp.fc2"),
        ):
            put(p + name + ".weight", src.weight)
            put(p + name + ".bias", src.bias)
    put(v + "post_layernorm.weight", bb.vision.post_layernorm.weight)
    put(v + "post_layernorm.bias", bb.vision.post_layernorm.bias)
    perm = _unshuffle_perm(cfg.vision.hidden_size)
    pj = bb.projector
    put("backbone.mlp1.0.weight", pj.norm.weight[perm])
    put("backbone.mlp1.0.bias", pj.norm.bias[perm])
    put("backbone.mlp1.1.weight", pj.fc1.weight[:, perm])
    put("backbone.mlp1.1.bias", pj.fc1.bias)
    put("backbone.mlp1.3.weight", pj.fc2.weight)
    put("backbone.mlp1.3.bias", pj.fc2.bias)
    lm = "backbone.language_model.model."
    put(lm + "embed_tokens.weight", bb.llm.embed_tokens.weight)
    for i, layer in enumerate(bb.llm.layers):
        p = f"{lm}layers.{i}."
        put(p + "input_layernorm.weight", layer.input_norm.weight)
        put(p + "post_attention_layernorm.weight", layer.post_attention_norm.weight)
        for n in ("q", "k", "v", "o"):
            put(p + f"self_attn.{n}_proj.weight", getattr(layer, f"{n}_proj").weight)
        put(p + "self_attn.q_norm.weight", layer.q_norm.weight)
        put(p + "self_attn.k_norm.weight", layer.k_norm.weight)
        for n in ("gate", "up", "down"):
            put(p + f"mlp.{n}_proj.weight", getattr(layer.mlp, f"{n}_proj").weight)
    ah = lb.action_head
    put("action_head.vlln.weight", ah.vlln.weight)
    put("action_head.vlln.bias", ah.vlln.bias)
    for mlp in ("state_encoder", "action_decoder"):
        for layer in ("layer1", "layer2"):
            src = getattr(getattr(ah, mlp), layer)
            put(f"action_head.{mlp}.{layer}.W", src.weight)
            put(f"action_head.{mlp}.{layer}.b", src.bias)
    for w in ("W1", "W2", "W3"):
        src = getattr(ah.action_encoder, w)
        put(f"action_head.action_encoder.{w}.W", src.weight)
        put(f"action_head.action_encoder.{w}.b", src.bias)
    put("action_head.position_embedding.weight", ah.position_embedding.weight)
    dit, m = ah.model, "action_head.model."
    for n in ("linear_1", "linear_2"):
        put(m + f"timestep_encoder.{n}.weight", getattr(dit.timestep_encoder, n).weight)
        put(m + f"timestep_encoder.{n}.bias", getattr(dit.timestep_encoder, n).bias)
    for i, blk in enumerate(dit.blocks):
        p = f"{m}transformer_blocks.{i}."
        pairs = (
            (blk.norm1_linear, "norm1.linear"),
            (blk.attn.to_q, "attn1.to_q"),
            (blk.attn.to_k, "attn1.to_k"),
            (blk.attn.to_v, "attn1.to_v"),
            (blk.attn.to_out, "attn1.to_out.0"),
            (blk.ff_in, "ff.proj"),
            (blk.ff_out, "ff.net.1"),
        )
        for src, name in pairs:
            put(p + name + ".weight", src.weight)
            put(p + name + ".bias", src.bias)
    for n in ("proj_out_1", "proj_out_2"):
        put(m + f"{n}.weight", getattr(dit, n).weight)
        put(m + f"{n}.bias", getattr(dit, n).bias)
    missing = sorted(set(dst) - copied - {"backbone.language_model.model.norm.weight"})
    if missing:
        raise KeyError(f"reference parameters not transferred: {missing[:8]} ...")


def make_batches(cfg: Any, n: int, batch: int, hw: tuple[int, int], seed: int) -> list[dict]:
    """Fixed synthetic batches (normalised pixels, prompts, padded state/action, draws)."""
    g = torch.Generator().manual_seed(seed)
    oh, ow = cfg.image.output_size(*hw)
    p = cfg.vision.patch_size
    tok = cfg.tokens_per_image(*hw)
    out = []
    for _ in range(n):
        pix = torch.rand(batch, 2, 3, oh, ow, generator=g) * 2 - 1
        text = torch.randint(
            1, min(cfg.llm.vocab_size, cfg.image_token_id), (batch, 24), generator=g
        )
        attn = torch.ones(batch, 24, dtype=torch.int64)
        attn[1::2, 18:] = 0
        ids = torch.randint(0, min(4, cfg.num_embodiments), (batch,), generator=g)
        sdim, adim = cfg.max_state_dim - 2, cfg.max_action_dim - 3
        smask = torch.zeros(batch, cfg.max_state_dim)
        smask[:, :sdim] = 1
        amask = torch.zeros(batch, cfg.action_horizon, cfg.max_action_dim)
        amask[:, : cfg.action_horizon - 2, :adim] = 1
        u = torch.rand(batch, generator=g)
        out.append({
            "pixels": pix, "text": text, "text_mask": attn, "embodiment_id": ids,
            "state": (torch.rand(batch, cfg.max_state_dim, generator=g) * 2 - 1) * smask,
            "state_mask": smask.bool(),
            "action": (torch.rand(batch, cfg.action_horizon, cfg.max_action_dim, generator=g)
                       * 2 - 1) * amask,
            "action_mask": amask,
            "noise": torch.randn(batch, cfg.action_horizon, cfg.max_action_dim, generator=g),
            "time": 0.999 * (1 - u.pow(1 / 1.5)),
            "grid": (oh // p, ow // p), "tokens_per_image": tok,
        })  # fmt: skip
    return out


def reference_batch(b: dict, cfg: Any, device: torch.device) -> dict:
    p = cfg.vision.patch_size
    bsz = b["pixels"].shape[0]
    gh, gw = b["grid"]
    pix = b["pixels"].flatten(0, 1)  # [B*2, 3, H, W]
    patches = (
        pix.reshape(-1, 3, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1).reshape(-1, gh * gw, p * p * 3)
    )
    n_img = 2 * b["tokens_per_image"]
    img = torch.full((bsz, n_img), cfg.image_token_id, dtype=torch.int64)
    batch = {
        "pixel_values": patches,
        "pixel_attention_mask": torch.ones(patches.shape[:2], dtype=torch.int64),
        "spatial_shapes": torch.tensor([[gh, gw]] * patches.shape[0]),
        "input_ids": torch.cat([img, b["text"]], 1),
        "attention_mask": torch.cat([torch.ones(bsz, n_img, dtype=torch.int64), b["text_mask"]], 1),
        "state": b["state"], "action": b["action"], "action_mask": b["action_mask"],
        "embodiment_id": b["embodiment_id"], "noise": b["noise"], "time": b["time"],
    }  # fmt: skip
    return {k: v.to(device) for k, v in batch.items()}


def longboat_batch(b: dict, device: torch.device) -> dict:
    keys = ("state", "state_mask", "action", "action_mask", "embodiment_id", "noise", "time")
    batch = {k: b[k] for k in keys}
    batch.update(images=b["pixels"], input_ids=b["text"], attention_mask=b["text_mask"])
    return {k: v.to(device) for k, v in batch.items()}


def write_results(
    args: argparse.Namespace,
    model: str,
    tag: str,
    config: dict[str, Any],
    ref_losses: list[float],
    lb_losses: list[float],
    *,
    ref_label: str,
    title: str,
) -> int:
    """``--out`` and ``<results-dir>/vla_loss_alignment_<date><tag>[_tiny][_master].{json,md,
    png}`` for either model; prints the markdown table."""
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref_losses, lb_losses)]
    result = {
        "benchmark": "vla_loss_alignment", "date": DATE, "gpu": gpu_name(),
        "versions": versions("transformers", "av", "triton"), "commit": git_commit(),
        "config": config,
        "runs": [{"name": "reference", "model": model, "losses": ref_losses},
                 {"name": "longboat", "model": model, "losses": lb_losses}],
        "max_rel_loss_diff": max(rel), "first_step_rel_diff": rel[0],
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    suffix = tag + ("_tiny" if args.tiny else "") + ("_master" if args.master_weights else "")
    stem = args.results_dir / f"vla_loss_alignment_{DATE}{suffix}"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    heading = f"vla_loss_alignment {tag.strip('_')} {DATE}".replace("  ", " ")
    md = (
        f"# {heading}\n\n{result['gpu']}, commit {result['commit']}\n\n"
        f"| steps | max per-step rel. loss diff | step-0 rel. diff | first loss (ref / longboat)"
        f" | last loss (ref / longboat) |\n|---|---|---|---|---|\n| {len(rel)} | "
        f"{max(rel):.4%} | {rel[0]:.4%} | {ref_losses[0]:.4f} / {lb_losses[0]:.4f} | "
        f"{ref_losses[-1]:.4f} / {lb_losses[-1]:.4f} |\n"
    )
    stem.with_suffix(".md").write_text(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(ref_losses, label=ref_label)
        ax.plot(lb_losses, label="longboat", linestyle="--")
        ax.set_xlabel("step")
        ax.set_ylabel("flow-matching loss")
        ax.set_title(f"{title} loss alignment (max rel diff {max(rel):.2%})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    print(md)
    return 0


def longboat_stepper(model: Any, optimizer: Any, optim: Any, args: Any, acc: Any) -> Any:
    """``step(batch_on_device, i) -> float``: longboat's step as the embodied trainer takes it.
    With ``--master-weights``: ``run_step`` over a ``GraphableStep`` (eager) with the NaN
    guard resolved one step late and the (constant) LR on the device, master weights in the
    trainer's default ``split`` storage; otherwise ``train_step`` (autocast)."""
    from longboat.core.config.schema import LRScheduleConfig, NaNGuardConfig
    from longboat.core.loop import NaNGuard, build_lr_scheduler
    from longboat.embodied.train.step import GraphableStep, LaggedGuard, run_step, train_step

    if not args.master_weights:

        def eager(batch: dict, i: int) -> float:
            out = train_step(
                model, optimizer, [batch], step=i, seed=args.seed, rank_offset=0,
                device_type=acc.device_type, precision="bf16", grad_clip=optim.grad_clip,
            )  # fmt: skip
            return float(out.loss)

        return eager
    fn = GraphableStep(
        model, optimizer, precision="bf16", device_type=acc.device_type,
        grad_clip=optim.grad_clip, skip_nonfinite_loss=True,
    )  # fmt: skip
    schedule = build_lr_scheduler(optimizer, LRScheduleConfig(name="constant"), args.steps)
    lagged = LaggedGuard(
        NaNGuard(NaNGuardConfig()), optimizer, schedule, total_steps=args.steps, accelerator=acc
    )

    def master(batch: dict, i: int) -> float:
        out = run_step(
            fn, optimizer, batch, step=i, seed=args.seed, rank_offset=0,
            device_type=acc.device_type, lagged=lagged,
        )  # fmt: skip
        return float(out.loss)

    return master


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks/results")
    p.add_argument("--time-budget", type=float, default=1e9)
    p.add_argument("--override", action="append", default=[], help="KEY=JSON_VALUE")
    p.add_argument("--model", default="groot_n1_6", choices=["groot_n1_6", "pi05"])
    p.add_argument("--lr", type=float, default=2.5e-5, help="pi05: the constant lr of both loops")
    p.add_argument(
        "--ref-precision", default="bfloat16", choices=["bfloat16", "float32"],
        help="pi05: the reference's weight precision (openpi trains in bfloat16)",
    )  # fmt: skip
    p.add_argument(
        "--master-weights", action="store_true",
        help="longboat with train.master_weights (bf16 weights + fp32 masters), the fast path",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.model == "pi05":
        return main_pi05(args)
    t_start = time.perf_counter()

    import longboat.embodied.models.groot_n1_6.backbone as lb_backbone
    from longboat.core.config.schema import OptimConfig
    from longboat.embodied.models import apply_freezing, build_model, get_config
    from longboat.embodied.parallel import ParallelSetup, build_optimizer, parallelize

    acc = get_accelerator()
    device = acc.device()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    overrides: dict[str, Any] = {"dit.dropout": 0.0}
    if args.tiny:
        overrides["vision.pos_grid"] = (4, 4)
        hw = (56, 56)
    else:
        hw = (252, 252)
    overrides.update(key_values(args.override, "--override"))
    cfg = get_config("groot_n1_6", "tiny" if args.tiny else "full", overrides)
    # Both sides get the same normalised pixels: longboat's on-device preprocessing is an
    # identity here (the reference's PIL path runs in its data workers, not in the model).
    lb_backbone.preprocess_images = lambda images, cfg, train, generator=None: images.float()

    torch.manual_seed(args.seed)
    with torch.device(device):
        lb = build_model("groot_n1_6", cfg)
        rf = ref.GR00TN16Reference(ref.RefShapes.from_groot_config(cfg))
    transfer_weights(lb, rf, cfg)
    apply_freezing(lb, cfg)
    ref.apply_reference_freezing(rf, ref.RefShapes.from_groot_config(cfg))
    lb.train()
    rf.train()
    setup = ParallelSetup(strategy="ddp", world_size=1, rank=0, device_type=acc.device_type)
    if args.master_weights:  # the fast path: bf16 weights, fp32 masters in the optimizer
        lb = parallelize(lb, setup, precision="bf16", master_weights=True)
    lb_optim = OptimConfig(lr=1e-4, weight_decay=1e-5, betas=[0.9, 0.999], grad_clip=1.0)
    lb_opt = build_optimizer(
        lb, lb_optim, setup, master_weights=args.master_weights, master_storage="split"
    )
    lb_step = longboat_stepper(lb, lb_opt, lb_optim, args, acc)
    rf_opt = ref.build_optimizer(rf, acc.device_type)
    batches = make_batches(cfg, min(args.steps, 16), args.batch, hw, args.seed)
    ref_losses, lb_losses = [], []
    for step in range(args.steps):
        b = batches[step % len(batches)]
        ref_losses.append(
            ref.train_step(rf, rf_opt, reference_batch(b, cfg, device), acc.device_type)
        )
        lb_losses.append(lb_step(longboat_batch(b, device), step))
        if time.perf_counter() - t_start > args.time_budget:
            print(f"time budget reached after {step + 1} steps", flush=True)
            break
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref_losses, lb_losses)]
    config = {"model": "groot_n1_6", "flavor": "tiny" if args.tiny else "full",
              "batch": args.batch, "steps": len(rel), "precision": "bf16",
              "master_weights": args.master_weights, "distinct_batches": len(batches),
              "overrides": {k: str(v) for k, v in overrides.items()}}  # fmt: skip
    return write_results(args, "groot_n1_6", "", config, ref_losses, lb_losses,
                         ref_label="reference", title="GR00T-N1.6")  # fmt: skip


# ----------------------------------------------------------------------------- pi0.5


def make_batches_pi05(cfg: Any, n: int, batch: int, seed: int) -> list[dict]:
    """Fixed longboat ``pi05`` batches: normalised square images on every camera slot (the
    last masked), prompts with padding, state with padded dims, actions, draws."""
    g = torch.Generator().manual_seed(seed)
    side = cfg.image.pad_to_square
    text_len = max(4, min(24, cfg.max_token_len - cfg.max_state_dim))
    sdim, adim = cfg.max_state_dim - 2, cfg.action_dim - 3
    out = []
    for _ in range(n):
        cams = torch.ones(batch, cfg.num_cameras, dtype=torch.bool)
        cams[:, -1] = False
        text_mask = torch.ones(batch, text_len, dtype=torch.bool)
        text_mask[1::2, text_len * 3 // 4 :] = False
        smask = torch.zeros(batch, cfg.max_state_dim, dtype=torch.bool)
        smask[:, :sdim] = True
        action = torch.zeros(batch, cfg.action_horizon, cfg.action_dim)
        action[..., :adim] = torch.rand(batch, cfg.action_horizon, adim, generator=g) * 2 - 1
        u = torch.rand(batch, generator=g)
        out.append({
            "images": torch.rand(batch, cfg.num_cameras, 3, side, side, generator=g) * 2 - 1,
            "image_mask": cams,
            "input_ids": torch.randint(1, cfg.bin_offset, (batch, text_len), generator=g),
            "attention_mask": text_mask,
            "state": (torch.rand(batch, cfg.max_state_dim, generator=g) * 2 - 1) * smask,
            "state_mask": smask,
            "action": action,
            "noise": torch.randn(batch, cfg.action_horizon, cfg.action_dim, generator=g),
            "time": u.pow(1 / 1.5) * 0.999 + 0.001,
        })  # fmt: skip
    return out


def build_pi05_pair(cfg: Any, device: torch.device, seed: int, ref_precision: str) -> tuple:
    """longboat ``Pi05`` (fp32, seeded) and the reference with its weights, both in train
    mode; longboat's frozen/trainable layout applied, the reference in ``ref_precision``."""
    import pi05_reference as pi05_ref

    from longboat.embodied.models import apply_freezing, build_model

    shapes = pi05_ref.RefShapes.from_pi05_config(cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        lb = build_model("pi05", cfg)
        rf = pi05_ref.Pi05Reference(shapes)
    pi05_ref.transfer_weights(lb, rf)
    rf.set_precision(ref_precision)
    rf.augment = False
    apply_freezing(lb, cfg)
    return lb.train(), rf.train(), shapes


def main_pi05(args: argparse.Namespace) -> int:
    import longboat.embodied.models.pi05.model as lb_pi05
    from longboat.embodied.models import get_config

    t_start = time.perf_counter()
    acc = get_accelerator()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    overrides = key_values(args.override, "--override")
    cfg = get_config("pi05", "tiny" if args.tiny else "full", overrides)
    # Both sides get the same normalised pixels (see the module doc); restored on return.
    original = lb_pi05.preprocess_images
    lb_pi05.preprocess_images = lambda images, cfg, train, generator=None: images.float()
    try:
        return _align_pi05(args, cfg, overrides, acc, t_start)
    finally:
        lb_pi05.preprocess_images = original


def _align_pi05(
    args: argparse.Namespace, cfg: Any, overrides: dict, acc: Any, t_start: float
) -> int:
    import pi05_reference as pi05_ref

    from longboat.core.config.schema import OptimConfig
    from longboat.embodied.parallel import ParallelSetup, build_optimizer, parallelize

    device = acc.device()
    lb, rf, shapes = build_pi05_pair(cfg, device, args.seed, args.ref_precision)
    setup = ParallelSetup(strategy="ddp", world_size=1, rank=0, device_type=acc.device_type)
    if args.master_weights:
        lb = parallelize(lb, setup, precision="bf16", master_weights=True)
    optim = OptimConfig(lr=args.lr, weight_decay=1e-10, betas=[0.9, 0.95], grad_clip=1.0)
    lb_opt = build_optimizer(
        lb, optim, setup, master_weights=args.master_weights, master_storage="split"
    )
    lb_step = longboat_stepper(lb, lb_opt, optim, args, acc)
    rf_opt = pi05_ref.build_optimizer(rf, lr=args.lr)
    batches = make_batches_pi05(cfg, min(args.steps, 16), args.batch, args.seed)
    ref_losses, lb_losses = [], []
    for step in range(args.steps):
        b = batches[step % len(batches)]
        rb = pi05_ref.to_device(pi05_ref.reference_batch_from_longboat(b, shapes), device)
        ref_losses.append(pi05_ref.train_step(rf, rf_opt, rb, step, lr=args.lr))
        lb_losses.append(lb_step({k: v.to(device) for k, v in b.items()}, step))
        if time.perf_counter() - t_start > args.time_budget:
            print(f"time budget reached after {step + 1} steps", flush=True)
            break
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref_losses, lb_losses)]
    config = {"model": "pi05", "flavor": "tiny" if args.tiny else "full",
              "batch": args.batch, "steps": len(rel), "precision": "bf16",
              "reference_precision": args.ref_precision, "lr": args.lr,
              "master_weights": args.master_weights, "distinct_batches": len(batches),
              "overrides": {k: str(v) for k, v in overrides.items()}}  # fmt: skip
    return write_results(args, "pi05", "_pi05", config, ref_losses, lb_losses,
                         ref_label="reference (openpi-style)", title="pi0.5")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
