"""Parity with LeRobot's own SmolVLA (lerobot 0.6.1): run by ``nox -s lerobot_parity``.

Skipped where lerobot is not installed (the default run). LeRobot builds SmolVLA's backbone
from the SmolVLM2 model that ``vlm_model_name`` names (its config.json and its processor);
here that is a tiny SmolVLM2 written by the test (``write_tiny_smolvlm``: a config with the
tiny flavor's shapes, a small local tokenizer carrying SmolVLM's image tokens, SmolVLM's
image and video processors), so nothing is downloaded and nothing of LeRobot is patched.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("lerobot", reason="lerobot is installed only by `nox -s lerobot_parity`")

from lerobot.configs import FeatureType, PolicyFeature
from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig as LeRobotSmolVLAConfig
from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
from lerobot_parity_kit import lerobot_loss_and_actions, our_loss_and_actions, perturb

from longboat.embodied.models.smolvla.lerobot_format import (
    lerobot_config_for,
    load_lerobot_smolvla,
    save_lerobot_smolvla,
)
from longboat.embodied.models.smolvla.lerobot_processors import save_lerobot_processors

pytestmark = pytest.mark.lerobot

CAMS = ["observation.images.top", "observation.images.wrist"]
STATE_DIM, ACTION_DIM, B, H, SIDE = 6, 5, 2, 10, 32
TRAIN_STEPS = 6


def write_tiny_smolvlm(directory: Path) -> Path:
    """A SmolVLM2 model directory at the tiny flavor's shapes (6 text layers, of which the
    policy keeps 4): config.json, tokenizer and processor files, saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, SmolVLMConfig
    from transformers.models.smolvlm import (
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    SmolVLMConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 8,
            "image_size": SIDE,
        },
        text_config={
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 1024,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
        scale_factor=2,
        tie_word_embeddings=False,
    ).save_pretrained(directory)
    specials = ["<|endoftext|>", "<unk>", "<image>", "<fake_token_around_image>", "<global-img>"]
    specials += ["<end_of_utterance>", "<video>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["pick up the red cube\n", "place the cup in the sink\n"] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        extra_special_tokens={
            "image_token": "<image>",
            "fake_image_token": "<fake_token_around_image>",
            "global_image_token": "<global-img>",
            "end_of_utterance_token": "<end_of_utterance>",
            "video_token": "<video>",
        },
    )
    SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(),
        tokenizer=fast,
        video_processor=SmolVLMVideoProcessor(),
        image_seq_len=4,
    ).save_pretrained(directory)
    return directory


def _lerobot_config(vlm: Path) -> LeRobotSmolVLAConfig:
    return LeRobotSmolVLAConfig(
        vlm_model_name=str(vlm),
        load_vlm_weights=False,
        num_vlm_layers=4,
        chunk_size=H,
        n_action_steps=H,
        max_state_dim=8,
        max_action_dim=8,
        resize_imgs_with_padding=(SIDE, SIDE),
        tokenizer_max_length=32,
        empty_cameras=1,  # a third, masked camera slot
        input_features={
            **{k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, SIDE, SIDE)) for k in CAMS},
            "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,)),
        },
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))},
        device="cpu",
    )


def _inputs(seed: int = 0, size: tuple[int, int] = (SIDE, SIDE)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    length = 12
    mask = torch.ones(B, length, dtype=torch.bool)
    mask[1, 8:] = False  # a shorter prompt: padding inside the prefix
    return {
        "images": torch.rand(B, len(CAMS), 3, *size, generator=gen),
        "tokens": torch.randint(0, 1024, (B, length), generator=gen),
        "mask": mask,
        "state": torch.randn(B, STATE_DIM, generator=gen),
        "action": torch.randn(B, H, ACTION_DIM, generator=gen),
        "noise": torch.randn(B, H, 8, generator=gen),
        "time": torch.rand(B, generator=gen) * 0.9 + 0.05,
    }


def _lerobot_batch(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    batch = {k: x["images"][:, i] for i, k in enumerate(CAMS)}
    batch["observation.language.tokens"] = x["tokens"]
    batch["observation.language.attention_mask"] = x["mask"]
    batch["observation.state"] = x["state"]
    batch["action"] = x["action"]
    return batch


def _our_batch(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    n_slots = len(CAMS) + 1
    images = torch.zeros(B, n_slots, 3, *x["images"].shape[-2:])
    images[:, : len(CAMS)] = x["images"]
    image_mask = torch.zeros(B, n_slots, dtype=torch.bool)
    image_mask[:, : len(CAMS)] = True
    state = torch.zeros(B, 8)
    state[:, :STATE_DIM] = x["state"]
    action = torch.zeros(B, H, 8)
    action[..., :ACTION_DIM] = x["action"]
    action_mask = torch.zeros(1, 1, 8, dtype=torch.bool)
    action_mask[..., :ACTION_DIM] = True
    return {
        "images": images,
        "image_mask": image_mask,
        "input_ids": x["tokens"],
        "attention_mask": x["mask"],
        "state": state,
        "action": action,
        "action_mask": action_mask,
        "noise": x["noise"],
        "time": x["time"],
    }


def _lerobot_loss_and_actions(policy: SmolVLAPolicy, x: dict[str, torch.Tensor]):
    return lerobot_loss_and_actions(policy, lambda: _lerobot_batch(x), x["noise"], x["time"])


def _our_loss_and_actions(model: torch.nn.Module, x: dict[str, torch.Tensor]):
    return our_loss_and_actions(model, _our_batch(x), x["noise"], ACTION_DIM)


def _assert_same(loss, ref_loss, actions, ref_actions, what: str) -> None:
    rel = ((loss - ref_loss).abs() / ref_loss.abs()).item()
    diff = (actions - ref_actions).abs().max().item()
    print(f"{what}: loss lerobot {ref_loss.item():.8f} longboat {loss.item():.8f} rel {rel:.2e}")
    print(f"{what}: actions max abs diff {diff:.2e}")
    assert rel < 1e-5
    torch.testing.assert_close(actions, ref_actions, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_smolvlm(tmp_path_factory.mktemp("tiny_smolvlm2"))


@pytest.fixture(scope="module")
def lerobot_dir(tmp_path_factory: pytest.TempPathFactory, vlm_dir: Path) -> Path:
    """A LeRobot-saved tiny SmolVLA with random weights."""
    out = tmp_path_factory.mktemp("lerobot_smolvla")
    torch.manual_seed(0)
    policy = SmolVLAPolicy(_lerobot_config(vlm_dir))
    perturb(policy, seed=1)
    policy.save_pretrained(out)
    return out


def test_init_from_lerobot_matches_lerobot(lerobot_dir: Path) -> None:
    """LeRobot's save_pretrained -> our loader: same training loss and sampled actions."""
    policy = SmolVLAPolicy.from_pretrained(lerobot_dir)
    ours, _ = load_lerobot_smolvla(lerobot_dir)
    x = _inputs()
    ref_loss, ref_actions = _lerobot_loss_and_actions(policy, x)
    loss, actions = _our_loss_and_actions(ours, x)
    _assert_same(loss, ref_loss, actions, ref_actions, "init_from")


def test_frames_of_another_size_are_resized_as_lerobot_does(lerobot_dir: Path) -> None:
    """48x40 frames: both resize to 32x32 keeping the aspect ratio, padding top and left."""
    policy = SmolVLAPolicy.from_pretrained(lerobot_dir)
    ours, _ = load_lerobot_smolvla(lerobot_dir)
    x = _inputs(seed=6, size=(48, 40))
    ref_loss, ref_actions = _lerobot_loss_and_actions(policy, x)
    loss, actions = _our_loss_and_actions(ours, x)
    _assert_same(loss, ref_loss, actions, ref_actions, "48x40 frames")


def test_trained_weights_export_and_load_in_lerobot(lerobot_dir: Path, tmp_path: Path) -> None:
    """LeRobot checkpoint in, a few optimiser steps on our model, our LeRobot export out:
    LeRobot's from_pretrained gives our loss and actions; its processors load our stats."""
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import (
        policy_action_to_transition,
        transition_to_policy_action,
    )

    ours, base = load_lerobot_smolvla(lerobot_dir)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    ours.train()
    losses = []
    for step in range(TRAIN_STEPS):
        batch = _our_batch(_inputs(seed=10 + step))
        loss = ours(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"trained {TRAIN_STEPS} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[k], v) for k, v in ours.state_dict().items())

    cfg = lerobot_config_for(
        ours, state_dim=STATE_DIM, action_dim=ACTION_DIM, camera_keys=CAMS, base=base
    )
    save_lerobot_smolvla(ours, tmp_path, cfg)
    gen = torch.Generator().manual_seed(3)
    stats = {
        key: {
            "mean": torch.randn(d, generator=gen),
            "std": torch.rand(d, generator=gen) + 0.5,
            "min": -torch.rand(d, generator=gen) - 1,
            "max": torch.rand(d, generator=gen) + 1,
        }
        for key, d in (("observation.state", STATE_DIM), ("action", ACTION_DIM))
    }
    save_lerobot_processors(tmp_path, cfg, stats)
    policy = SmolVLAPolicy.from_pretrained(tmp_path)
    x = _inputs(seed=4)
    ref_loss, ref_actions = _lerobot_loss_and_actions(policy, x)
    loss, actions = _our_loss_and_actions(ours, x)
    _assert_same(loss, ref_loss, actions, ref_actions, "export")
    # Loading our export back gives the same model.
    again, _ = load_lerobot_smolvla(tmp_path)
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, rtol=0, atol=0)

    post = PolicyProcessorPipeline.from_pretrained(
        tmp_path,
        config_filename="policy_postprocessor.json",
        to_transition=policy_action_to_transition,
        to_output=transition_to_policy_action,
    )
    y = torch.randn(B, ACTION_DIM)
    mean, std = stats["action"]["mean"], stats["action"]["std"]
    torch.testing.assert_close(post(y), y * std + mean, rtol=1e-5, atol=1e-5)
    # The preprocessor's tokenizer step loads the backbone's tokenizer (vlm_model_name).
    pre = PolicyProcessorPipeline.from_pretrained(
        tmp_path, config_filename="policy_preprocessor.json"
    )
    names = [type(s).__name__ for s in pre.steps]
    assert "NewLineTaskProcessorStep" in names and "TokenizerProcessorStep" in names
    norm = next(s for s in pre.steps if type(s).__name__ == "NormalizerProcessorStep")
    state = norm.state_dict()
    for key in ("observation.state", "action"):
        for stat in ("mean", "std"):
            torch.testing.assert_close(state[f"{key}.{stat}"], stats[key][stat])


def test_trained_run_exports_to_lerobot(lerobot_dir: Path, vlm_dir: Path, tmp_path: Path) -> None:
    """A longboat run started from the LeRobot checkpoint (model.init_from; the tokenizer
    found through its vlm_model_name), trained 20 steps, writes its LeRobot directory itself
    (export.format=auto). LeRobot's own preprocessor, loaded from it, tokenises the raw
    samples' prompts as longboat's collator did and normalises the state alike, and
    LeRobot's from_pretrained predicts our actions from its output."""
    from lerobot.processor.converters import batch_to_transition, transition_to_batch
    from lerobot.processor.pipeline import PolicyProcessorPipeline

    from longboat.core.config.compose import compose_experiment
    from longboat.embodied.data import LeRobotDataset
    from longboat.embodied.models.smolvla.processor import PromptTokenizer
    from longboat.embodied.train.export import load_exported_policy
    from longboat.embodied.train.trainer import train

    run = tmp_path / "run"
    steps = 20
    cfg = compose_experiment(
        "smolvla_tiny",
        [
            f"output_dir={run}",
            f"model.init_from={lerobot_dir}",
            f"train.steps={steps}",
            "train.micro_batch_size=2",
            "train.global_batch_size=null",
            "optim.lr=1e-3",
            "logging.progress=false",
            "logging.trackers=[]",
            "data.synthetic.num_episodes=2",
            "data.synthetic.episode_length=12",
        ],
        world_size=1,
    )
    losses = train(cfg).losses
    assert len(losses) == steps
    print(f"trained {steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    out = run / "export" / "lerobot"
    ours = load_exported_policy(run / "export")
    assert ours.cfg.backbone_prompts
    policy = SmolVLAPolicy.from_pretrained(out)
    start, _ = load_lerobot_smolvla(lerobot_dir)
    moved = sum(
        (a.float() - b.float()).abs().sum().item()
        for a, b in zip(ours.state_dict().values(), start.state_dict().values(), strict=True)
    )
    assert moved > 0  # training changed the weights

    pre = PolicyProcessorPipeline.from_pretrained(
        out,
        config_filename="policy_preprocessor.json",
        to_transition=batch_to_transition,
        to_output=transition_to_batch,
    )
    ds = LeRobotDataset(
        run / "dataset", normalization={"observation.state": "min_max", "action": "min_max"}
    )
    rows = [0, 7, 13, 20]
    samples = [ds[i] for i in rows]
    cams = [k for k in policy.config.image_features if "empty_camera" not in k]
    raw = {k: torch.stack([s[k] for s in samples]) for k in cams}
    raw["observation.state"] = torch.as_tensor(
        ds._columns["observation.state"][rows], dtype=torch.float32
    )
    raw["task"] = [s["task"] for s in samples]
    theirs = pre(raw)
    ids, mask = PromptTokenizer(vlm_dir, ours.cfg.prompt_length())(
        [s["task"] for s in samples], [s["observation.state"] for s in samples]
    )
    their_ids = theirs["observation.language.tokens"].cpu()
    their_mask = theirs["observation.language.attention_mask"].cpu().bool()
    n = their_ids.shape[1]  # LeRobot pads to the longest prompt, longboat to max_length
    assert torch.equal(their_ids, ids[:, :n]) and torch.equal(their_mask, mask[:, :n])
    assert not mask[:, n:].any()
    state = torch.stack([s["observation.state"] for s in samples]).float()
    torch.testing.assert_close(theirs["observation.state"].float(), state, rtol=1e-5, atol=1e-5)

    b = len(rows)
    noise = torch.randn(b, H, 8, generator=torch.Generator().manual_seed(5))
    policy.eval()
    with mock.patch.object(policy.model, "sample_noise", lambda shape, device: noise):
        ref = policy.predict_action_chunk(theirs)
    n_slots = ours.cfg.num_cameras
    images = torch.zeros(b, n_slots, 3, SIDE, SIDE)
    image_mask = torch.zeros(b, n_slots, dtype=torch.bool)
    for i, k in enumerate(cams):
        images[:, i], image_mask[:, i] = raw[k], True
    padded_state = torch.zeros(b, ours.cfg.max_state_dim)
    padded_state[:, : state.shape[1]] = state
    ours.eval()
    got = ours.predict_action(
        {
            "images": images,
            "image_mask": image_mask,
            "input_ids": ids,
            "attention_mask": mask,
            "state": padded_state,
        },
        noise=noise,
    )[..., : ref.shape[-1]]
    print(f"actions max abs diff {(got - ref).abs().max().item():.2e}")
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
