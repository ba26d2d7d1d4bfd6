"""The openpi-style pi0.5 reference of ``tools/bench`` (``baselines/pi05_reference.py``):
same shapes and parameters as longboat's ``pi05``, identical step-0 loss after the weight
transfer on identical batches and draws, a training step, its data path, and the
``--model pi05`` runs of ``vla_throughput.py`` / ``vla_loss_alignment.py`` at tiny shapes."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def ref():
    from baselines import pi05_reference

    return pi05_reference


def make_batches(cfg, n: int, batch: int, seed: int) -> list[dict]:
    """longboat ``pi05`` batches: normalised square images on every camera slot (the last
    masked), prompts with padding, state with padded dims, actions, flow-matching draws."""
    g = torch.Generator().manual_seed(seed)
    side, text_len = cfg.image.pad_to_square, max(4, min(24, cfg.max_token_len - cfg.max_state_dim))
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
        out.append({
            "images": torch.rand(batch, cfg.num_cameras, 3, side, side, generator=g) * 2 - 1,
            "image_mask": cams, "attention_mask": text_mask,
            "input_ids": torch.randint(1, cfg.bin_offset, (batch, text_len), generator=g),
            "state": (torch.rand(batch, cfg.max_state_dim, generator=g) * 2 - 1) * smask,
            "state_mask": smask, "action": action,
            "noise": torch.randn(batch, cfg.action_horizon, cfg.action_dim, generator=g),
            "time": torch.rand(batch, generator=g).pow(1 / 1.5) * 0.999 + 0.001,
        })  # fmt: skip
    return out


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


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """longboat's tiny pi05 as ``longboat-embodied train experiment=pi05_tiny`` builds it
    (fp32, its synthetic dataset), through the stack's ``build_training``, with the prompts
    the reference reads (the byte-level stand-in, ``model.tokenizer=byte``)."""
    from bench_train import build_training, compose

    out = tmp_path_factory.mktemp("pi05_built")
    data = ["data.synthetic.num_episodes=2", "data.synthetic.episode_length=12"]
    data.append("model.tokenizer=byte")
    training = build_training("embodied")(compose("embodied", "pi05_tiny", data, str(out)))
    yield training
    training.close()


def _pair(ref, built, seed: int = 0, perturb: bool = True):
    """A copy of the built longboat pi05 (fp32) and the reference with its weights (fp32).
    ``perturb``: the zero-initialised adaRMSNorm modulations get random values first,
    otherwise every expert layer is an identity at step 0 and the loss would not depend on
    the prefix at all."""
    from longboat.embodied.parallel import unwrap

    cfg = built.model_cfg
    lb = copy.deepcopy(unwrap(built.model))
    if perturb:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for m in lb.modules():
                if hasattr(m, "modulation"):
                    m.modulation.weight.normal_(0, 0.3, generator=g)
                    m.modulation.bias.normal_(0, 0.3, generator=g)
    shapes = ref.RefShapes.from_pi05_config(cfg)
    rf = ref.Pi05Reference(shapes)
    ref.transfer_weights(lb, rf)
    rf.augment = False
    return cfg, shapes, lb.train(), rf.train()


def test_shapes_and_parameter_counts_match(ref, built):
    """Same shapes as longboat's config; the reference has exactly one extra tensor (the LM's
    final norm, llm.hidden_size values). longboat freezes the last LM layer's unused prefix
    path; the reference keeps it trainable (openpi), so trainable counts differ by exactly
    that. At full shapes (built on the meta device) the reference has 3.353e9 + 2048."""
    from longboat.embodied.models import get_config
    from longboat.embodied.parallel import unwrap

    cfg = built.model_cfg
    s = ref.RefShapes.from_pi05_config(cfg)
    assert (s.image_size, s.tokens_per_image, s.max_token_len, s.bin_offset) == (56, 16, 48, 768)
    unused = sum(p.numel() for p in unwrap(built.model).joint.unused_parameters())
    lb_counts = built.counts
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
    with torch.device("meta"):
        rf_full = ref.Pi05Reference(ref.RefShapes.from_pi05_config(get_config("pi05", "full", {})))
    assert abs(sum(p.numel() for p in rf_full.parameters()) - 2048 - 3.353e9) < 1e6


def test_step0_loss_equals_longboat_fp32(ref, built, identity_preprocess):
    """fp32, same weights, same batch, same noise/time: the losses agree to 1e-5 relative
    (observed: bit-identical on CPU). Negative control: swapping q and k of the first ViT
    layer (a transfer bug) moves the loss by 1.2e-3 relative, 120x the tolerance; junk in
    the masked camera and in the prompt padding does not move it."""
    cfg, s, lb, rf = _pair(ref, built)
    batch = make_batches(cfg, 1, 3, seed=7)[0]
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


def test_bf16_reference_tracks_longboat_fp32(ref, built, identity_preprocess):
    """The openpi precision layout (bf16 weights, fp32 norms, no autocast) stays within 0.2%
    of longboat's fp32 step-0 loss (observed 4e-5)."""
    cfg, s, lb, _ = _pair(ref, built)
    batch = make_batches(cfg, 1, 2, seed=3)[0]
    lb_loss0 = lb(batch)["loss"].item()
    rf16 = ref.Pi05Reference(s)
    ref.transfer_weights(lb, rf16)
    rf16.set_precision("bfloat16")
    rf16.augment = False
    rf16_loss = rf16.train()(ref.reference_batch_from_longboat(batch, s)).mean().item()
    assert abs(rf16_loss - lb_loss0) <= 2e-3 * lb_loss0, (rf16_loss, lb_loss0)


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
        "--steps", "2", "--warmup", "1", "--workers", "0", "--embodiments", "2",
        "--episodes", "2", "--episode-length", "12", "16", "--data-dir", str(tmp_path / "ds"),
        "--results-dir", str(tmp_path / "res"), "--runs", runs,
    ]  # fmt: skip


def test_vla_throughput_pi05_tiny(tmp_path, monkeypatch, ref):
    """``vla_throughput.py --model pi05 --tiny``: the reference (per-sample decode + PIL in the
    loader, openpi's step) and longboat's default, master-weights and graphed runs train 2
    steps on the same dataset (on CPU the graphed step runs eagerly: the master run's losses)."""
    import vla_throughput
    from baselines import pi05_reference_data as data

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rc = vla_throughput.main(
        _bench_args(tmp_path, "reference,longboat,longboat_master,longboat_graphed")
    )
    result = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, result
    assert result["config"]["model"] == "pi05" and result["config"]["model_cameras"] == 3
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["reference", "longboat", "longboat_master", "longboat_graphed"]
    for run in runs.values():
        assert run["model"] == "pi05" and run["timed_steps"] == 2
        assert all(math.isfinite(x) and 0.2 < x < 10.0 for x in run["losses"]), run["losses"]
    assert runs["longboat_master"]["losses"] == runs["longboat_graphed"]["losses"]
    ref_p, lb_p = runs["reference"]["params"], runs["longboat"]["params"]
    assert ref_p["total"] - (lb_p["trainable"] + lb_p["frozen"]) == 64
    assert (tmp_path / "res" / f"vla_throughput_{result['date']}_pi05_tiny.md").is_file()
    # The reference's data path: 3 camera slots (the dataset has 2), prompt padded to 48.
    s = ref.RefShapes.from_pi05_config(_cfg())
    roots = sorted(p for p in (tmp_path / "ds").iterdir() if p.is_dir())
    sample = data.Pi05ReferenceDataset(roots, s)[5]
    assert sample["images"].shape == (3, 56, 56, 3) and sample["images"].dtype == torch.uint8
    assert sample["image_mask"].tolist() == [True, True, False]
    assert sample["images"][:2].float().std() > 0 and sample["images"][2].eq(0).all()
    assert sample["tokenized_prompt"].shape == (48,)
    assert sample["action"].shape == (10, 8)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_vla_loss_alignment_pi05_tiny(tmp_path, precision):
    """``vla_loss_alignment.py --model pi05 --tiny``, the reference in fp32, on the batches of
    the built run, lr 1e-3 so the weights move: longboat in bf16 autocast within 0.3%
    relative (observed 0.1%); longboat in fp32 within 1e-5 (the same math: bit-identical on CPU)."""
    import vla_loss_alignment

    out = tmp_path / "align.json"
    rc = vla_loss_alignment.main(
        ["--model", "pi05", "--tiny", "--steps", "3", "--batch", "2", "--ref-precision",
         "float32", "--out", str(out), "--results-dir", str(tmp_path), "--data-dir",
         str(tmp_path / "ds"), "--embodiments", "2", "--episodes", "2",
         "--episode-length", "12", "16", "--lr", "1e-3", "--precision", precision]
    )  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "pi05" and result["config"]["steps"] == 3
    assert result["max_rel_loss_diff"] < (3e-3 if precision == "bf16" else 1e-5), result
    losses = {r["name"]: r["losses"] for r in result["runs"]}["reference"]
    assert losses[2] != losses[0]  # the weights moved
