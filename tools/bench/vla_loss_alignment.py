"""VLA loss alignment: the reference GR00T-N1.6 (or pi0.5) loop vs longboat from the same
initial weights, on the same batches with the same flow-matching draws.

    python tools/bench/vla_loss_alignment.py --out results.json [--model groot_n1_6|pi05]
        [--steps 200] [--batch 8] [--tiny] [--master-weights] [--memory-budget GB]
        [--results-dir DIR]

- ``longboat``: ``longboat-embodied train experiment=<model>_tiny`` (``model=<model>`` at full
  shapes) on vla_throughput's synthetic dataset (square frames), bf16 (``--precision fp32`` with
  pi0.5's ``--ref-precision float32``: the same math on both sides), batch ``--batch``, the
  reference's optimizer recipe (GR00T: AdamW 1e-4, betas 0.9/0.999, wd 1e-5; pi0.5: openpi's
  AdamW at a constant ``--lr``, betas 0.9/0.95, wd 1e-10; clip 1.0, constant LR) and the model
  overrides below; ``--master-weights`` adds ``train.master_weights=true`` (``longboat_master``);
  ``--memory-budget GB`` adds ``train.memory_budget=GB``, so longboat trains with what its
  memory plan chooses there (pi0.5 at the openpi-style reference's 33 GB: bf16 moments and
  bf16_sr weights, which change numerics), and records the plan's line.
- ``reference``: the baseline's model and step (``baselines/``), its weights copied from the model
  longboat built (``transfer_weights``: GR00T's fused ViT qkv split into q/k/v, the conv patch
  embedding as Siglip2's linear over (p, p, 3) patches, the projector's input channels from
  ``F.pixel_unshuffle`` to Eagle's ``pixel_shuffle`` order; pi0.5:
  ``pi05_reference.transfer_weights``; with master weights the fp32 masters), trained on the very
  batches longboat trains on (``training.batches(0)``): the first ``--distinct`` (default: one per
  step, so no batch repeats and the curves do not follow a few memorised batches), cycled.
- ``reference_perturbed``: the reference with every batch's samples reversed: the noise band
  (``bench_align``).

What makes them comparable: each batch carries flow-matching ``noise`` and ``time`` drawn here
(both models read them instead of drawing); the image crop is off (``image.crop_fraction=1.0``),
so longboat's on-device preprocessing is deterministic and the reference gets its very pixels
(``preprocess_images``, as Siglip2 patches for GR00T); DiT dropout is 0 (masks cannot match
across implementations); GR00T's ViT position table is square (``vision.pos_grid`` 4x4 tiny,
18x18 full). pi0.5's reference runs without augmentation at ``--ref-precision`` (openpi: bf16
weights, fp32 norms), the prompt = text ids + state bins padded to ``max_token_len``, and
longboat's batch without its action mask (openpi averages the loss over every padded dim).
"""

from __future__ import annotations

import argparse
import copy
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import bench_align
import torch
import torch.nn.functional as F
import vla_throughput as vt
from baselines import groot_n1_6_reference as groot_ref
from baselines import pi05_reference as pi05_ref
from bench_env import REPO, key_values, result_meta, write_results
from bench_train import train_timed


def _unshuffle_perm(d: int) -> torch.Tensor:
    """perm[k] = longboat projector channel that Eagle's channel k holds."""
    x = torch.arange(4 * 4 * d, dtype=torch.float64).reshape(1, 16, d)
    lb = F.pixel_unshuffle(x.transpose(1, 2).reshape(1, d, 4, 4), 2).flatten(2).transpose(1, 2)
    ea = groot_ref.eagle_pixel_shuffle(x.reshape(1, 4, 4, d)).reshape(1, -1, 4 * d)
    pos = {float(v): i for i, v in enumerate(lb[0, 0].tolist())}
    return torch.tensor([pos[float(v)] for v in ea[0, 0].tolist()])


@torch.no_grad()
def transfer_weights(lb: Any, rf: Any, cfg: Any) -> None:
    """Copy every weight of longboat's GrootN16 into the (fp32) reference model."""
    copied: set[str] = set()
    dst = dict(rf.named_parameters())

    def put(name: str, value: torch.Tensor) -> None:
        if dst[name].shape != value.shape:
            raise ValueError(f"{name}: {tuple(value.shape)} -> {tuple(dst[name].shape)}")
        dst[name].copy_(value)
        copied.add(name)

    def put_linear(prefix: str, src: Any) -> None:
        put(prefix + ".weight", src.weight)
        put(prefix + ".bias", src.bias)

    v, bb = "backbone.vision_model.", lb.backbone
    patch = bb.vision.patch_embed
    linear = patch.weight.permute(0, 2, 3, 1).reshape(cfg.vision.hidden_size, -1)  # (p, p, 3)
    put(v + "embeddings.patch_embedding.weight", linear)
    put(v + "embeddings.patch_embedding.bias", patch.bias)
    put(v + "embeddings.position_embedding.weight", bb.vision.pos_embed)
    for i, blk in enumerate(bb.vision.blocks):
        p = f"{v}encoder.layers.{i}."
        for n, w, b in zip("qkv", blk.qkv.weight.chunk(3, 0), blk.qkv.bias.chunk(3, 0)):
            put(p + f"self_attn.{n}_proj.weight", w)
            put(p + f"self_attn.{n}_proj.bias", b)
        for src, name in ((blk.out_proj, "self_attn.out_proj"), (blk.layer_norm1, "layer_norm1"),
                          (blk.layer_norm2, "layer_norm2"), (blk.fc1, "mlp.fc1"),
                          (blk.fc2, "mlp.fc2")):  # fmt: skip
            put_linear(p + name, src)
    put_linear(v + "post_layernorm", bb.vision.post_layernorm)
    perm, pj = _unshuffle_perm(cfg.vision.hidden_size), bb.projector
    put("backbone.mlp1.0.weight", pj.norm.weight[perm])
    put("backbone.mlp1.0.bias", pj.norm.bias[perm])
    put("backbone.mlp1.1.weight", pj.fc1.weight[:, perm])
    put("backbone.mlp1.1.bias", pj.fc1.bias)
    put_linear("backbone.mlp1.3", pj.fc2)
    lm = "backbone.language_model.model."
    put(lm + "embed_tokens.weight", bb.llm.embed_tokens.weight)
    for i, layer in enumerate(bb.llm.layers):
        p = f"{lm}layers.{i}."
        put(p + "input_layernorm.weight", layer.input_norm.weight)
        put(p + "post_attention_layernorm.weight", layer.post_attention_norm.weight)
        for n in "qkvo":
            put(p + f"self_attn.{n}_proj.weight", getattr(layer, f"{n}_proj").weight)
        put(p + "self_attn.q_norm.weight", layer.q_norm.weight)
        put(p + "self_attn.k_norm.weight", layer.k_norm.weight)
        for n in ("gate", "up", "down"):
            put(p + f"mlp.{n}_proj.weight", getattr(layer.mlp, f"{n}_proj").weight)
    put(lm + "norm.weight", bb.llm.norm.weight)  # both read the LM after its final norm
    ah = lb.action_head
    put_linear("action_head.vlln", ah.vlln)
    for mlp in ("state_encoder", "action_decoder"):
        for layer in ("layer1", "layer2"):
            src = getattr(getattr(ah, mlp), layer)
            put(f"action_head.{mlp}.{layer}.W", src.weight)
            put(f"action_head.{mlp}.{layer}.b", src.bias)
    for w in ("W1", "W2", "W3"):
        put(f"action_head.action_encoder.{w}.W", getattr(ah.action_encoder, w).weight)
        put(f"action_head.action_encoder.{w}.b", getattr(ah.action_encoder, w).bias)
    put("action_head.position_embedding.weight", ah.position_embedding.weight)
    dit, m = ah.model, "action_head.model."
    for n in ("linear_1", "linear_2"):
        put_linear(m + f"timestep_encoder.{n}", getattr(dit.timestep_encoder, n))
    for i, blk in enumerate(dit.blocks):
        p = f"{m}transformer_blocks.{i}."
        for src, name in ((blk.norm1_linear, "norm1.linear"), (blk.attn.to_q, "attn1.to_q"),
                          (blk.attn.to_k, "attn1.to_k"), (blk.attn.to_v, "attn1.to_v"),
                          (blk.attn.to_out, "attn1.to_out.0"), (blk.ff_in, "ff.proj"),
                          (blk.ff_out, "ff.net.1")):  # fmt: skip
            put_linear(p + name, src)
    for n in ("proj_out_1", "proj_out_2"):
        put_linear(m + n, getattr(dit, n))
    missing = sorted(set(dst) - copied)
    if missing:
        raise KeyError(f"reference parameters not transferred: {missing[:8]} ...")


def groot_reference_batch(b: dict, pixels: torch.Tensor, cfg: Any) -> dict:
    """The GR00T reference's view of a longboat batch: Siglip2 patches, placeholders + prompt."""
    p, (bsz, cams) = cfg.vision.patch_size, pixels.shape[:2]
    gh, gw = pixels.shape[-2] // p, pixels.shape[-1] // p
    flat = pixels.flatten(0, 1).reshape(-1, 3, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1)
    patches = flat.reshape(-1, gh * gw, p * p * 3)
    n_img = cams * cfg.tokens_per_image(pixels.shape[-2], pixels.shape[-1])
    img = torch.full((bsz, n_img), cfg.image_token_id, dtype=torch.int64)
    text_mask = b["attention_mask"].long()
    return {
        "pixel_values": patches,
        "pixel_attention_mask": torch.ones(patches.shape[:2], dtype=torch.int64),
        "spatial_shapes": torch.tensor([[gh, gw]] * patches.shape[0]),
        "input_ids": torch.cat([img, b["input_ids"]], 1),
        "attention_mask": torch.cat([torch.ones(bsz, n_img, dtype=torch.int64), text_mask], 1),
        **{k: b[k] for k in ("state", "action", "action_mask", "embodiment_id", "noise", "time")},
    }


class Reference:
    """The baseline's model + optimizer + step for ``--model``, with longboat's weights."""

    def __init__(self, args: Any, training: Any, device: torch.device) -> None:
        from longboat.embodied.parallel import MasterWeightAdamW, unwrap

        self.args, self.cfg, self.device = args, training.model_cfg, device
        lb, opt = unwrap(training.model), training.optimizer
        masters = opt.master_params() if isinstance(opt, MasterWeightAdamW) else nullcontext()
        with torch.device(device), masters:
            if args.model == "pi05":
                self.shapes = pi05_ref.RefShapes.from_pi05_config(self.cfg)
                self.model = pi05_ref.Pi05Reference(self.shapes)
                pi05_ref.transfer_weights(lb, self.model)
            else:
                self.shapes = groot_ref.RefShapes.from_groot_config(self.cfg)
                self.model = groot_ref.GR00TN16Reference(self.shapes)
                transfer_weights(lb, self.model, self.cfg)
        if args.model == "pi05":
            self.model.set_precision(args.ref_precision)
            self.model.augment = False
        else:
            groot_ref.apply_reference_freezing(self.model, self.shapes)
        self.model.train()
        self.initial = copy.deepcopy(self.model.state_dict())

    def losses(self, batches: list[dict], steps: int, reverse: bool) -> list[float]:
        """``steps`` steps from the initial weights over ``batches`` (cycled)."""
        from longboat.embodied.models.common.image_preprocessing import preprocess_images

        self.model.load_state_dict(self.initial)
        if self.args.model == "pi05":
            opt = pi05_ref.build_optimizer(self.model, lr=self.args.lr)
        else:
            opt = groot_ref.build_optimizer(self.model, self.device.type)
        out = []
        for i in range(steps):
            b = batches[i % len(batches)]
            b = {k: v.flip(0) if reverse else v for k, v in b.items()}
            # on the batch's device, as longboat computes them
            pixels = preprocess_images(b["images"], self.cfg.image, train=False).cpu()
            b = {k: v.cpu() for k, v in b.items()}
            if self.args.model == "pi05":
                rb = pi05_ref.reference_batch_from_longboat({**b, "images": pixels}, self.shapes)
                rb = pi05_ref.to_device(rb, self.device)
                out.append(pi05_ref.train_step(self.model, opt, rb, i, lr=self.args.lr))
            else:
                rb = groot_ref.to_device(groot_reference_batch(b, pixels, self.cfg), self.device)
                out.append(groot_ref.train_step(self.model, opt, rb, self.device.type))
        return out


def with_draws(batch: dict, cfg: Any, model: str, g: torch.Generator) -> dict:
    """``batch`` plus flow-matching noise and time drawn from ``g`` (both models read them);
    pi0.5: without ``action_mask`` (openpi's loss is the mean over every padded dim)."""
    if model == "pi05":
        batch = {k: v for k, v in batch.items() if k != "action_mask"}
    bsz, horizon, adim = batch["action"].shape
    u = torch.rand(bsz, generator=g)
    time = u.pow(1 / 1.5) * 0.999 + 0.001 if model == "pi05" else 0.999 * (1 - u.pow(1 / 1.5))
    device = batch["action"].device
    noise = torch.randn(bsz, horizon, adim, generator=g)
    return {**batch, "noise": noise.to(device), "time": time.to(device)}


def recipe(args: Any) -> list[str]:
    """The reference's optimizer recipe and the comparability overrides, as config keys."""
    if args.model == "pi05":
        optim = [f"optim.lr={args.lr}", "optim.weight_decay=1e-10", "optim.betas=[0.9,0.95]"]
        model = {"image.crop_fraction": 1.0}
    else:
        optim = ["optim.lr=1e-4", "optim.weight_decay=1e-5", "optim.betas=[0.9,0.999]"]
        model = {"dit.dropout": 0.0, "image.crop_fraction": 1.0}
        if args.tiny:
            model["vision.pos_grid"] = [4, 4]
    optim += ["optim.eps=1e-8", "optim.grad_clip=1.0", "optim.schedule.name=constant",
              "optim.schedule.warmup_steps=0"]  # fmt: skip
    args.overrides = {**model, **args.overrides}
    return optim


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="groot_n1_6", choices=list(vt.EXPERIMENT))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--distinct", type=int, default=0,
                   help="distinct batches, cycled over the steps (0: one per step)")  # fmt: skip
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2.5e-5, help="pi05: the constant lr of both loops")
    p.add_argument("--ref-precision", default="bfloat16", choices=["bfloat16", "float32"],
                   help="pi05: the reference's weights (openpi trains in bfloat16)")  # fmt: skip
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="longboat's train.precision (pi05 fp32 + --ref-precision float32: the "
                   "same math on both sides)")  # fmt: skip
    p.add_argument("--master-weights", action="store_true", help="longboat with train.master_weights")  # fmt: skip
    p.add_argument("--memory-budget", default=None,
                   help="longboat with train.memory_budget=<GB> (the plan's storage choices)")  # fmt: skip
    p.add_argument("--variants", default=None,
                   help="comma-separated vla_throughput.VARIANTS to align in one process against "
                   "one reference curve (default: longboat, or longboat_master with "
                   "--master-weights)")  # fmt: skip
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks/results")
    vt.add_data_args(p)
    p.set_defaults(embodiments=2, episodes=4, episode_length=[24, 32])
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps: at least 3")
    args.workers, args.overrides = 0, key_values(args.override, "--override")
    optim = recipe(args)
    from longboat.core.device import get_accelerator
    from longboat.embodied.models import get_config

    acc = get_accelerator()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    cfg = get_config(args.model, "tiny" if args.tiny else "full", args.overrides)
    root = vt.dataset_for(args, cfg, (56, 56) if args.tiny else (256, 256))
    names = (args.variants or ("longboat_master" if args.master_weights else "longboat")).split(",")
    unknown = [n for n in names if n not in vt.VARIANTS]
    if unknown:
        p.error(f"--variants: {unknown} are not in {sorted(vt.VARIANTS)}")
    name = names[0]
    seen: dict[str, Any] = {}

    def prepare(training: Any) -> None:
        if "batches" not in seen:  # the first variant's batches and weights, for every run
            g = torch.Generator().manual_seed(args.seed)
            it = training.batches(0)
            batches = [with_draws(next(it)[0], training.model_cfg, args.model, g)
                       for _ in range(min(args.distinct or args.steps, args.steps))]  # fmt: skip
            seen.update(batches=batches, reference=Reference(args, training, training.device))

    def feed(training: Any) -> Any:
        batches = seen["batches"]
        return lambda start: ([batches[i % len(batches)]] for i in range(start, 10**9))

    def plan_line(training: Any) -> dict[str, Any]:
        plan = training.memory_plan
        return {"plan_line": plan if isinstance(plan, str) else plan.line()}

    budget = [] if args.memory_budget is None else [f"train.memory_budget={args.memory_budget}"]
    losses, plans = {}, {}
    for variant in names:
        ov = [*vt.longboat_overrides(args, root), *optim, *vt.VARIANTS[variant], *budget]
        r = train_timed("embodied", vt.EXPERIMENT[args.model], ov, acc, warmup=1,
                        steps=args.steps - 2, prepare=prepare, feed=feed,
                        probe=plan_line)  # fmt: skip
        losses[variant], plans[variant] = r["losses"], r.get("plan_line")
        print(f"{variant}: {plans[variant]}")
    rf = seen["reference"]
    curves = {"reference": rf.losses(seen["batches"], args.steps, reverse=False),
              "reference_perturbed": rf.losses(seen["batches"], args.steps, reverse=True),
              **losses}  # fmt: skip
    config = {"model": args.model, "flavor": "tiny" if args.tiny else "full", "batch": args.batch,
              "steps": args.steps, "precision": args.precision, "longboat_overrides": ov,
              "master_weights": args.master_weights, "distinct_batches": len(seen["batches"]),
              "memory_budget": args.memory_budget, "memory_plans": plans,
              "variants": {n: vt.VARIANTS[n] for n in names},
              "perturbation": "samples of every batch in reverse order"}  # fmt: skip
    if args.model == "pi05":
        config.update(reference_precision=args.ref_precision, lr=args.lr)
    result = result_meta("vla_loss_alignment", acc.device_type != "cpu", vt.PEERS, config)
    result["runs"] = [{"name": k, "model": args.model, "losses": v} for k, v in curves.items()]
    band = (curves["reference"], curves["reference_perturbed"])
    verdicts = {n: bench_align.judge(curves[n], *band, relative=True) for n in names}
    result["verdict"] = v = verdicts[name]
    result["verdicts"] = verdicts
    result["max_rel_loss_diff"] = v["max_diff"]
    first = {n: abs(curves[n][0] / curves["reference"][0] - 1) for n in names}
    result["first_step_rel_diff"], result["first_step_rel_diffs"] = first[name], first
    tag = ("_pi05" if args.model == "pi05" else "") + ("_tiny" if args.tiny else "")
    tag += ("_master" if args.master_weights and not args.variants else "") + (
        "_variants" if len(names) > 1 else ""
    )
    tag += f"_budget{args.memory_budget}" if args.memory_budget is not None else ""
    title = f"vla_loss_alignment {args.model} {result['date']} (max rel diff {v['max_diff']:.2%})"
    tables = [
        f"{n}:\n" + bench_align.table({**result, "verdict": vd}, n) for n, vd in verdicts.items()
    ]
    table = "\n".join(tables)
    write_results(result, out=args.out, results_dir=args.results_dir,
                  stem=f"vla_loss_alignment_{result['date']}{tag}", table=table,
                  plot=bench_align.plot(result, title, "flow-matching loss"))  # fmt: skip
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
