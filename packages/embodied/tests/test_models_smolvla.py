"""SmolVLA: shapes, masking, the KV cache, freezing, LeRobot's format (without lerobot),
the full flavor's size, and training through the real trainer with an exact resume."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from longboat.core.checkpoint.errors import CheckpointError
from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.embodied.models import apply_freezing, build_model
from longboat.embodied.models.smolvla.lerobot_format import (
    lerobot_config_for,
    load_lerobot_smolvla,
    save_lerobot_smolvla,
)
from longboat.embodied.models.synthetic import synthetic_batch
from longboat.embodied.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return build_model("smolvla", "tiny", overrides=overrides or None)


def _fixed_draw(batch, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    batch["noise"] = torch.randn(batch["action"].shape, generator=g)
    batch["time"] = torch.rand(batch["action"].shape[0], generator=g)
    return batch


def test_forward_shapes_and_finite_loss():
    m = _model()
    batch = synthetic_batch(m, 3)
    out = m(batch)
    assert out["pred_velocity"].shape == (3, 10, 8)
    assert torch.isfinite(out["loss"])


def test_masked_cameras_and_padded_tokens_do_not_change_the_loss():
    m = _model().eval()
    batch = _fixed_draw(synthetic_batch(m, 4))
    ref = m(batch)["loss"]
    other = dict(batch)
    other["images"] = batch["images"].clone()
    other["images"][:, -1] = 255 - other["images"][:, -1]  # the masked camera
    other["input_ids"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], 7)
    assert torch.equal(m(other)["loss"], ref)
    other["images"][:, 0] = 0  # a visible camera does change it
    assert not torch.equal(m(other)["loss"], ref)


def test_kv_cache_prediction_equals_uncached_and_is_causal_in_the_suffix():
    m = _model().eval()
    batch = synthetic_batch(m, 2)
    noise = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(1))
    cached = m.predict_action(batch, noise=noise)
    torch.testing.assert_close(
        m.predict_action(batch, noise=noise, use_cache=False), cached, rtol=0, atol=1e-6
    )
    # The action tokens attend causally: changing the last step's noise leaves the
    # velocity of every earlier step unchanged.
    prefix, valid, blocks = m.embed_prefix(batch)
    t = torch.full((2,), 0.5)
    v1 = m._velocity(m.joint(prefix, valid, blocks, m.embed_suffix(noise, t)))
    changed = noise.clone()
    changed[:, -1] += 1.0
    v2 = m._velocity(m.joint(prefix, valid, blocks, m.embed_suffix(changed, t)))
    torch.testing.assert_close(v1[:, :-1], v2[:, :-1], rtol=0, atol=1e-6)
    assert not torch.allclose(v1[:, -1], v2[:, -1])


def test_default_freezing_trains_the_expert_and_the_state_projection_only():
    m = _model(tune_visual=False, tune_llm=False)
    counts = apply_freezing(m)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable and all(
        n.startswith(("joint.layers.", "expert_norm", "state_proj", "action_")) for n in trainable
    )
    assert not any(".lm." in n for n in trainable)
    m(synthetic_batch(m, 2))["loss"].backward()
    got = {n for n, p in m.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got == trainable
    assert counts["trainable"] == sum(p.numel() for p in m.parameters() if p.requires_grad)


def test_full_flavor_parameter_count_on_meta():
    m = build_model("smolvla", "full", device="meta")
    n = sum(p.numel() for p in m.parameters())
    # LeRobot's smolvla_base: these plus the VLM's lm_head (49280 x 960) and the text
    # model's final norm, which cannot change actions and are not kept (~450M in all).
    assert n == 402_736_416
    assert abs(n + 49280 * 960 + 960 - 450e6) < 1e6


def _vlm_dir(tmp_path: Path) -> Path:
    """A SmolVLM2 config.json at the tiny flavor's shapes (what LeRobot's config names)."""
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    cfg = {
        "model_type": "smolvlm",
        "scale_factor": 2,
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 8,
            "image_size": 32,
        },
        "text_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 1024,
            "rms_norm_eps": 1e-5,
        },
    }
    (vlm / "config.json").write_text(json.dumps(cfg))
    return vlm


def test_lerobot_format_round_trip_is_exact(tmp_path: Path):
    vlm = str(_vlm_dir(tmp_path))
    m = _model(vlm_model_name=vlm).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    base = {"type": "smolvla", "vlm_model_name": vlm, "num_vlm_layers": 4}
    cfg = lerobot_config_for(
        m, state_dim=6, action_dim=5, camera_keys=["observation.images.top"], base=base
    )
    assert cfg["empty_cameras"] == 2 and cfg["resize_imgs_with_padding"] == [32, 32]
    save_lerobot_smolvla(m, tmp_path / "lr", cfg)
    again, read = load_lerobot_smolvla(tmp_path / "lr")
    assert read["num_vlm_layers"] == 4 and again.cfg == m.cfg
    for k, v in m.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    batch = _fixed_draw(synthetic_batch(m, 2))
    assert torch.equal(again.eval()(batch)["loss"], m(batch)["loss"])
    # Another backbone than the one vlm_model_name describes is refused, naming the key.
    with pytest.raises(ConfigError, match="vlm_model_name"):
        lerobot_config_for(
            _model(**{"vision.num_layers": 1, "vlm_model_name": vlm}),
            state_dim=6,
            action_dim=5,
            camera_keys=[],
            base=base,
        )
    # Weights that do not fit the config: every mismatching key is listed.
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "lr" / "model.safetensors"))
    state.pop("model.state_proj.bias")
    save_file(state, str(tmp_path / "lr" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 missing: model\.state_proj\.bias"):
        load_lerobot_smolvla(tmp_path / "lr")


def _run(out: Path, steps: int):
    return compose_experiment(
        "smolvla_tiny",
        [
            f"output_dir={out}",
            f"train.steps={steps}",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.log_every=1",
            "optim.schedule.warmup_steps=2",
            "checkpoint.every_steps=0",
            "logging.progress=false",
            "logging.trackers=[]",
            "export.enabled=false",
            "data.synthetic.num_episodes=2",
            "data.synthetic.episode_length=12",
        ],
        world_size=1,
    )


def test_tiny_trains_through_the_trainer_and_resumes_bit_exactly(tmp_path: Path):
    """experiment=smolvla_tiny through the real trainer: finite losses, and a run stopped
    by Ctrl-C after step 3 resumes to the uninterrupted run's losses, bit for bit."""
    steps = 6
    straight = train(_run(tmp_path / "straight", steps)).losses
    assert len(straight) == steps and all(torch.isfinite(torch.tensor(straight)))
    assert len(set(straight)) == steps

    def ctrl_c(step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    out = tmp_path / "stopped"
    first = train(_run(out, steps), on_step=ctrl_c)
    assert first.stopped_by_signal == "SIGINT" and first.end_step == 3
    again = train(_run(out, steps))
    assert again.resumed_from == first.checkpoint
    assert first.losses + again.losses == straight


def test_a_run_from_a_lerobot_checkpoint_needs_the_backbone_tokenizer(tmp_path: Path):
    """The tokenizer is found through the checkpoint's vlm_model_name; without one the run
    is a ConfigError naming model.tokenizer; a byte-level run is not written as LeRobot."""
    from longboat.embodied.models import policy
    from longboat.embodied.models.smolvla.processor import PromptTokenizer, find_tokenizer
    from longboat.embodied.train.reference_formats import run_tokenizer

    vlm = _vlm_dir(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"type": "smolvla", "vlm_model_name": str(vlm)}))
    assert find_tokenizer(None, str(ckpt)) is None  # the backbone has no tokenizer files yet
    cfg = compose_experiment("smolvla_tiny", [f"model.init_from={ckpt}"], world_size=1)
    with pytest.raises(ConfigError, match=r"model\.tokenizer"):
        run_tokenizer(cfg)

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["pick up the cube\n"] * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>").save_pretrained(str(vlm))
    assert find_tokenizer(None, str(ckpt)) == vlm
    ids, mask = PromptTokenizer(vlm, 8)(["pick up the cube", "pick\n"], [None, None])
    assert ids.shape == (2, 8) and mask.sum(1).tolist()[1] < mask.sum(1).tolist()[0]
    # A newline ends every prompt, once.
    assert torch.equal(PromptTokenizer(vlm, 8)(["pick\n"], [None])[0], ids[1:])
    lerobot = policy("smolvla").export_format("lerobot")
    assert "model.tokenizer" in lerobot.unavailable(_model().cfg, 1)
    assert "vlm_model_name" in lerobot.unavailable(_model(backbone_prompts=True).cfg, 1)
    described = _model(backbone_prompts=True, vlm_model_name=str(vlm)).cfg
    assert lerobot.unavailable(described, 1) is None
    assert "2 sub-datasets" in lerobot.unavailable(described, 2)


def test_unsupported_lerobot_settings_are_config_errors_naming_them(tmp_path: Path):
    from longboat.embodied.models.smolvla.lerobot_format import config_from_lerobot

    vlm = str(_vlm_dir(tmp_path))
    base = {"type": "smolvla", "vlm_model_name": vlm, "num_vlm_layers": 4}
    assert config_from_lerobot(base).text.num_layers == 4
    for bad, named in (
        ({"add_image_special_tokens": True}, "add_image_special_tokens"),
        ({"num_expert_layers": 2}, "num_expert_layers=2"),
        ({"resize_imgs_with_padding": [64, 64]}, "resize_imgs_with_padding"),
        ({"vlm_model_name": str(tmp_path / "absent")}, "vlm_model_name"),
    ):
        with pytest.raises(ConfigError, match=named):
            config_from_lerobot({**base, **bad})


def test_flops_count_the_backward_only_where_parts_train():
    from longboat.embodied.models import policy

    family = policy("smolvla")
    frozen = family.flops_per_sample(family.flavor("full"), 2, (512, 512), 48)
    trained = family.flops_per_sample(
        build_model("smolvla", "full", overrides={"tune_llm": True}, device="meta").cfg,
        2,
        (512, 512),
        48,
    )
    assert 0 < frozen < trained < 3 * frozen
