"""The openpi-style pi0.5 reference of ``tools/bench`` (``baselines/pi05_reference.py``):
same shapes and parameters as longboat's ``pi05``, identical step-0 loss after the weight
transfer on identical batches and draws, a training step, its data path, and the
``--model pi05`` runs of ``vla_throughput.py`` / ``vla_loss_alignment.py`` at tiny shapes."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "tools" / "bench"
pytestmark = [
    pytest.mark.skipif(
        not (BENCH / "baselines" / "pi05_reference.py").is_file(),
        reason="tools/ is not part of an installed wheel",
    ),
    pytest.mark.usefixtures("one_thread"),
]


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    for d in (BENCH, BENCH / "baselines"):
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ref():
    return _load("pi05_reference", BENCH / "baselines" / "pi05_reference.py")


@pytest.fixture(scope="module")
def align():
    return _load("vla_loss_alignment_bench", BENCH / "vla_loss_alignment.py")


@pytest.fixture
def identity_preprocess(monkeypatch):
    """Both loops see the same normalised pixels (the reference's augmentation is off)."""
    import longboat.embodied.models.pi05.model as lb_pi05

    monkeypatch.setattr(
        lb_pi05, "preprocess_images", lambda images, cfg, train, generator=None: images.float()
    )


def _cfg():
    from longboat.embodied.models import get_config

    return get_config("pi05", "tiny", {})


def _pair(ref, seed: int = 0, perturb: bool = True):
    """longboat tiny pi05 (fp32) and the reference with its weights (fp32). ``perturb``: the
    zero-initialised adaRMSNorm modulations get random values first, otherwise every expert
    layer is an identity at step 0 and the loss would not depend on the prefix at all."""
    from longboat.embodied.models import build_model

    cfg = _cfg()
    shapes = ref.RefShapes.from_pi05_config(cfg)
    torch.manual_seed(seed)
    lb = build_model("pi05", cfg)
    if perturb:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for m in lb.modules():
                if hasattr(m, "modulation"):
                    m.modulation.weight.normal_(0, 0.3, generator=g)
                    m.modulation.bias.normal_(0, 0.3, generator=g)
    rf = ref.Pi05Reference(shapes)
    ref.transfer_weights(lb, rf)
    rf.augment = False
    return cfg, shapes, lb.train(), rf.train()


def test_shapes_and_parameter_counts_match(ref):
    """Same shapes as longboat's config; the reference has exactly one extra tensor (the LM's
    final norm, llm.hidden_size values) at tiny and at full shapes (built on the meta
    device). longboat freezes the last LM layer's unused prefix path; the reference keeps
    it trainable (openpi), so trainable counts differ by exactly that."""
    from longboat.embodied.models import apply_freezing, build_model, get_config

    cfg = _cfg()
    s = ref.RefShapes.from_pi05_config(cfg)
    assert (s.image_size, s.tokens_per_image, s.max_token_len, s.bin_offset) == (56, 16, 48, 768)
    torch.manual_seed(0)
    lb = build_model("pi05", cfg)
    unused = sum(p.numel() for p in lb.joint.unused_parameters())
    lb_counts = apply_freezing(lb, cfg)
    rf = ref.build_reference(s, "cpu", precision="bfloat16")
    rf_counts = ref.parameter_counts(rf)
    lb_total = lb_counts["trainable"] + lb_counts["frozen"]
    assert rf_counts["total"] - lb_total == cfg.llm.hidden_size == 64
    assert lb_counts["frozen"] == unused
    assert rf_counts["trainable"] - lb_counts["trainable"] == unused + cfg.llm.hidden_size
    # openpi's precision layout: bf16 VLM + expert, fp32 norms / patch + position embeddings,
    # fp32 action and time projections.
    pwe = rf.paligemma_with_expert
    emb = pwe.vision_model.embeddings
    assert emb.patch_embedding.weight.dtype == emb.position_embedding.weight.dtype == torch.float32
    assert pwe.vision_model.encoder.layers[0].mlp.fc1.weight.dtype == torch.bfloat16
    lm0, ex0 = pwe.language_model.layers[0], pwe.gemma_expert.layers[0]
    assert lm0.self_attn.q_proj.weight.dtype == ex0.mlp.up_proj.weight.dtype == torch.bfloat16
    assert lm0.input_layernorm.weight.dtype == torch.float32
    assert ex0.post_attention_layernorm.dense.weight.dtype == torch.float32
    assert pwe.gemma_expert.norm.dense.weight.dtype == torch.float32
    assert rf.action_in_proj.weight.dtype == rf.time_mlp_out.weight.dtype == torch.float32

    full = get_config("pi05", "full", {})
    with torch.device("meta"):
        lb_full = build_model("pi05", full)
        rf_full = ref.Pi05Reference(ref.RefShapes.from_pi05_config(full))
    n_lb = sum(p.numel() for p in lb_full.parameters())
    n_rf = sum(p.numel() for p in rf_full.parameters())
    assert n_rf - n_lb == 2048
    assert abs(n_lb - 3.353e9) < 1e6


def test_step0_loss_equals_longboat_fp32(ref, align, identity_preprocess):
    """fp32, same weights, same batch, same noise/time: the losses agree to 1e-5 relative
    (observed: bit-identical on CPU). Negative control: swapping q and k of the first ViT
    layer (a transfer bug) moves the loss by 1.2e-3 relative, 120x the tolerance; junk in
    the masked camera and in the prompt padding does not move it."""
    cfg, s, lb, rf = _pair(ref)
    batch = align.make_batches_pi05(cfg, 1, 3, seed=7)[0]
    rb = ref.reference_batch_from_longboat(batch, s)
    lb_loss = lb(batch)["loss"].item()
    rf_loss = rf(rb).mean().item()
    assert math.isfinite(lb_loss) and lb_loss > 0.1
    assert abs(rf_loss - lb_loss) <= 1e-5 * lb_loss, (rf_loss, lb_loss)
    # The prefix reaches the loss (images -> ViT -> joint attention -> actions).
    q = rf.paligemma_with_expert.vision_model.encoder.layers[0].self_attn.q_proj
    k = rf.paligemma_with_expert.vision_model.encoder.layers[0].self_attn.k_proj
    with torch.no_grad():
        qw, kw = q.weight.clone(), k.weight.clone()
        q.weight.copy_(kw)
        k.weight.copy_(qw)
    swapped = rf(rb).mean().item()
    assert abs(swapped - lb_loss) > 20 * 1e-5 * lb_loss, (swapped, lb_loss)
    # The masked camera and the prompt padding do not reach it.
    junk = dict(rb)
    junk["images"] = rb["images"].clone()
    junk["images"][:, -1] = 5.0
    junk["tokenized_prompt"] = torch.where(
        rb["tokenized_prompt_mask"],
        rb["tokenized_prompt"],
        torch.full_like(rb["tokenized_prompt"], 9),
    )
    with torch.no_grad():
        q.weight.copy_(qw)
        k.weight.copy_(kw)
    assert abs(rf(junk).mean().item() - rf_loss) <= 1e-6 * rf_loss


def test_bf16_reference_and_training_steps_track_longboat(ref, align, identity_preprocess):
    """The openpi precision layout (bf16 weights, fp32 norms, no autocast) stays within 0.2%
    of longboat's fp32 step-0 loss (observed 4e-5); three optimizer steps in fp32 on both
    sides (AdamW 0.9 / 0.95, wd 1e-10, clip 1.0, lr 1e-3) keep the losses within 1e-5
    relative (observed: bit-identical)."""
    from longboat.core.config.schema import OptimConfig
    from longboat.embodied.parallel import ParallelSetup, build_optimizer
    from longboat.embodied.train.step import train_step

    cfg, s, lb, rf = _pair(ref)
    batches = align.make_batches_pi05(cfg, 3, 2, seed=3)
    lb_loss0 = lb(batches[0])["loss"].item()
    rf16 = ref.Pi05Reference(s)
    ref.transfer_weights(lb, rf16)
    rf16.set_precision("bfloat16")
    rf16.augment = False
    rf16_loss = rf16.train()(ref.reference_batch_from_longboat(batches[0], s)).mean().item()
    assert abs(rf16_loss - lb_loss0) <= 2e-3 * lb_loss0, (rf16_loss, lb_loss0)

    setup = ParallelSetup(strategy="ddp", world_size=1, rank=0, device_type="cpu")
    lr = 1e-3
    lb_opt = build_optimizer(
        lb, OptimConfig(lr=lr, weight_decay=1e-10, betas=[0.9, 0.95], grad_clip=1.0), setup
    )
    rf_opt = ref.build_optimizer(rf, lr=lr)
    ref_losses, lb_losses = [], []
    for step, b in enumerate(batches):
        rb = ref.reference_batch_from_longboat(b, s)
        ref_losses.append(ref.train_step(rf, rf_opt, rb, step, lr=lr))
        out = train_step(
            lb, lb_opt, [b], step=step, seed=0, rank_offset=0, device_type="cpu",
            precision="fp32", grad_clip=1.0,
        )  # fmt: skip
        lb_losses.append(float(out.loss))
    for a, b in zip(ref_losses, lb_losses, strict=True):
        assert abs(a - b) <= 1e-5 * b, (ref_losses, lb_losses)
    assert ref_losses[2] != ref_losses[0]  # the weights moved


def test_training_step_with_augmentation_and_sampled_draws(ref):
    """uint8 HWC frames (the loader's layout), openpi's on-device augmentation, sampled
    noise / time, gradient checkpointing: one step gives a finite loss and moves weights."""
    s = ref.RefShapes.from_pi05_config(_cfg())
    torch.manual_seed(0)
    rf = ref.build_reference(s, "cpu", precision="float32")
    assert rf.gradient_checkpointing and rf.augment
    g = torch.Generator().manual_seed(0)
    b = 2
    tokens = torch.randint(1, s.bin_offset, (b, s.max_token_len), generator=g)
    mask = torch.zeros(b, s.max_token_len, dtype=torch.bool)
    mask[:, :20] = True
    batch = {
        "images": torch.randint(0, 256, (b, 3, 56, 56, 3), generator=g, dtype=torch.uint8),
        "image_mask": torch.tensor([[True, True, False]] * b),
        "tokenized_prompt": tokens,
        "tokenized_prompt_mask": mask,
        "state": torch.zeros(b, s.max_state_dim),
        "action": torch.rand(b, s.horizon, s.action_dim, generator=g) * 2 - 1,
    }
    opt = ref.build_optimizer(rf, lr=1e-3)
    w = rf.action_out_proj.weight.detach().clone()
    loss = ref.train_step(rf, opt, batch, 0, lr=1e-3)
    assert math.isfinite(loss) and 0.2 < loss < 10.0
    assert not torch.equal(w, rf.action_out_proj.weight)
    assert ref.lr_at(0) == pytest.approx(2.5e-5 / 1001)
    assert ref.lr_at(1000) == pytest.approx(2.5e-5)
    assert ref.lr_at(30_000) == pytest.approx(2.5e-6)


def test_prompt_tokens_and_state_bins(ref):
    """Text then one token per real state dim at the top of the vocab, padded; bins follow
    np.digitize semantics and agree with longboat's ``discretize_state``."""
    import numpy as np

    from longboat.embodied.models.pi05.model import discretize_state

    s = ref.RefShapes.from_pi05_config(_cfg())
    state = np.array([-1.0, -0.999, 0.0, 0.5, 0.999, 1.0, -3.0, 3.0], np.float32)
    bins = ref.discretize_state(state, 256)
    assert bins.tolist() == discretize_state(torch.from_numpy(state)[None], 256)[0].tolist()
    tokens, mask = ref.tokenize_prompt([5, 6, 7], state[:6], s)
    assert tokens.shape == mask.shape == (48,)
    assert mask.sum() == 9 and mask[:9].all()
    assert tokens[:3].tolist() == [5, 6, 7]
    assert tokens[3:9].tolist() == (bins[:6] + s.bin_offset).tolist()


def _bench_args(tmp_path, runs: str) -> list[str]:
    return [
        "--out", str(tmp_path / "results.json"), "--model", "pi05", "--tiny", "--batch", "2",
        "--steps", "2", "--warmup", "0", "--workers", "0", "--embodiments", "2",
        "--episodes", "2", "--episode-length", "12", "16", "--data-dir", str(tmp_path / "ds"),
        "--results-dir", str(tmp_path / "res"), "--runs", runs,
    ]  # fmt: skip


def test_vla_throughput_pi05_tiny(tmp_path, monkeypatch):
    """``vla_throughput.py --model pi05 --tiny``: the reference (per-sample decode + PIL in the
    loader, openpi's step) and longboat each train 2 steps on the same synthetic dataset."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bench = _load("vla_throughput_bench", BENCH / "vla_throughput.py")
    rc = bench.main(_bench_args(tmp_path, "reference,longboat"))
    result = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, result
    assert result["config"]["model"] == "pi05" and result["config"]["model_cameras"] == 3
    runs = {r["name"]: r for r in result["runs"]}
    assert set(runs) == {"reference", "longboat"}
    for run in runs.values():
        assert run["model"] == "pi05" and run["timed_steps"] == 2
        assert all(math.isfinite(x) and 0.2 < x < 10.0 for x in run["losses"]), run["losses"]
    ref_p, lb_p = runs["reference"]["params"], runs["longboat"]["params"]
    assert ref_p["total"] - (lb_p["trainable"] + lb_p["frozen"]) == 64
    assert (tmp_path / "res" / f"vla_throughput_{result['date']}_pi05_tiny.md").is_file()
    # The reference's data path: 3 camera slots (the dataset has 2), prompt padded to 48.
    data = _load("pi05_reference_data", BENCH / "baselines" / "pi05_reference_data.py")
    ref = _load("pi05_reference", BENCH / "baselines" / "pi05_reference.py")
    s = ref.RefShapes.from_pi05_config(_cfg())
    roots = sorted(p for p in (tmp_path / "ds").iterdir() if p.is_dir())
    sample = data.Pi05ReferenceDataset(roots, s)[5]
    assert sample["images"].shape == (3, 56, 56, 3) and sample["images"].dtype == torch.uint8
    assert sample["image_mask"].tolist() == [True, True, False]
    assert sample["images"][:2].float().std() > 0 and sample["images"][2].eq(0).all()
    assert sample["tokenized_prompt"].shape == (48,)
    assert sample["action"].shape == (10, 8)


def test_vla_throughput_pi05_master_and_graphed_tiny(tmp_path, monkeypatch):
    """longboat's master-weights and graphed step paths run pi05 (on CPU GraphedStep runs the
    step eagerly: this checks GraphableStep and the fixed-shape collation, not the capture)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bench = _load("vla_throughput_bench", BENCH / "vla_throughput.py")
    rc = bench.main(_bench_args(tmp_path, "longboat_master,longboat_graphed"))
    result = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, result
    for run in result["runs"]:
        assert all(math.isfinite(x) and 0.2 < x < 10.0 for x in run["losses"]), run


def test_vla_loss_alignment_pi05_tiny(tmp_path, align):
    """``vla_loss_alignment.py --model pi05 --tiny`` (reference in fp32, longboat in bf16
    autocast): 2 steps within 0.2% relative (observed 0.06%)."""
    out = tmp_path / "align.json"
    rc = align.main(
        ["--model", "pi05", "--tiny", "--steps", "2", "--batch", "2", "--ref-precision",
         "float32", "--out", str(out), "--results-dir", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "pi05" and result["config"]["steps"] == 2
    assert result["max_rel_loss_diff"] < 2e-3, result
