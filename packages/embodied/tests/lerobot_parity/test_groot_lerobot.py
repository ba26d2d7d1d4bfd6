"""Parity with LeRobot's own GR00T (lerobot 0.6.1): run by ``nox -s lerobot_parity``.

LeRobot 0.6.1's ``groot`` policy is GR00T N1.7: a Qwen3-VL backbone (Cosmos-Reason2) and
the action head N1.6 also has (vlln, per-embodiment state / action encoders and decoder,
position embedding, the alternating self / cross-attention DiT with AdaLN, flow matching
with Beta(1.5, 1) times, Euler sampling). The backbones differ (N1.6: Eagle, SigLIP2 +
pixel-unshuffle projector + Qwen3), so the comparison feeds both action heads the same
backbone features, masks, state, embodiment ids, noise and time: the training loss within
1e-5 relative and the sampled actions within 1e-4 (fp32, CPU). See
``longboat.embodied.models.groot_n1_6.lerobot_format`` for every difference.

LeRobot is built from a tiny config with random weights and nothing downloaded: a tiny
Qwen3-VL config directory, a GR00T N1.7 base model saved from it, and the policy on top.
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("lerobot", reason="lerobot is installed only by `nox -s lerobot_parity`")

from lerobot.configs import FeatureType, PolicyFeature
from lerobot.policies.groot.configuration_groot import GrootConfig
from lerobot.policies.groot.groot_n1_7 import GR00TN17, GR00TN17Config
from lerobot.policies.groot.modeling_groot import GrootPolicy
from lerobot_parity_kit import perturb
from transformers import Qwen3VLConfig
from transformers.feature_extraction_utils import BatchFeature

from longboat.embodied.models.groot_n1_6.lerobot_format import (
    config_from_lerobot_groot,
    load_lerobot_action_head,
    read_lerobot_groot,
    save_lerobot_groot,
)
from longboat.embodied.models.groot_n1_6.model import GrootN16

pytestmark = pytest.mark.lerobot

B, L, WIDTH, HORIZON, MAX_DIM, STATE_DIM, ACTION_DIM = 2, 12, 64, 10, 8, 6, 5
CAM = "observation.images.front"


@pytest.fixture(scope="module")
def lerobot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LeRobot-saved tiny GR00T N1.7 policy with random weights (its base model next to it)."""
    root = tmp_path_factory.mktemp("lerobot_groot")
    qwen, base, policy_dir = root / "qwen3_vl", root / "base", root / "policy"
    Qwen3VLConfig(
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
        tie_word_embeddings=True,
        text_config={
            "hidden_size": WIDTH,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 128,
            "vocab_size": 512,
            "rope_scaling": {
                "mrope_interleaved": True,
                "mrope_section": [4, 2, 2],
                "rope_type": "default",
            },
            "rope_theta": 1e6,
            "tie_word_embeddings": True,
            "max_position_embeddings": 256,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": WIDTH,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [],
        },
    ).save_pretrained(qwen)
    torch.manual_seed(0)
    GR00TN17(
        GR00TN17Config(
            model_name=str(qwen),
            backbone_embedding_dim=WIDTH,
            select_layer=3,
            max_state_dim=MAX_DIM,
            max_action_dim=MAX_DIM,
            action_horizon=HORIZON,
            hidden_size=32,
            input_embedding_dim=64,
            max_seq_len=32,
            max_num_embodiments=4,
            state_dropout_prob=0.0,
            load_bf16=False,
            diffusion_model_cfg={
                "positional_embeddings": None,
                "num_layers": 4,
                "num_attention_heads": 4,
                "attention_head_dim": 16,
                "norm_type": "ada_norm",
                "dropout": 0.0,
                "final_dropout": True,
                "output_dim": 32,
                "interleave_self_attention": True,
            },
            vl_self_attention_cfg={"num_layers": 0},
        ),
        load_backbone_weights=False,
    ).save_pretrained(base)
    policy = GrootPolicy(
        GrootConfig(
            base_model_path=str(base),
            chunk_size=HORIZON,
            n_action_steps=HORIZON,
            max_state_dim=MAX_DIM,
            max_action_dim=MAX_DIM,
            use_bf16=False,
            device="cpu",
            input_features={
                CAM: PolicyFeature(type=FeatureType.VISUAL, shape=(3, 56, 84)),
                "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,)),
            },
            output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))},
        )
    )
    perturb(policy, seed=1)
    policy.save_pretrained(policy_dir)
    return policy_dir


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, 9:] = False  # a shorter prompt
    is_image = torch.zeros(B, L, dtype=torch.bool)
    is_image[:, :4] = True  # 4 image tokens, then text
    action = torch.zeros(B, HORIZON, MAX_DIM)
    action[..., :ACTION_DIM] = torch.randn(B, HORIZON, ACTION_DIM, generator=gen)
    mask = torch.zeros(B, HORIZON, MAX_DIM)
    mask[..., :ACTION_DIM] = 1.0
    mask[1, 7:] = 0.0  # padded steps at an episode end
    action[1, 7:] = (
        0.0  # longboat zeroes masked entries before noising; LeRobot noises them as given
    )
    state = torch.zeros(B, MAX_DIM)
    state[:, :STATE_DIM] = torch.rand(B, STATE_DIM, generator=gen) * 2 - 1
    return {
        "features": torch.randn(B, L, WIDTH, generator=gen),
        "valid": valid,
        "is_image": is_image,
        "state": state,
        "action": action,
        "action_mask": mask,
        "embodiment_id": torch.tensor([0, 3]),
        "noise": torch.randn(B, HORIZON, MAX_DIM, generator=gen),
        "time": torch.rand(B, generator=gen) * 0.9 + 0.05,
    }


def _lerobot_loss_and_actions(policy: GrootPolicy, x: dict[str, torch.Tensor]):
    """LeRobot's action head on ``x``'s backbone features (its own forward / get_action)."""
    head = policy._groot_model.action_head
    policy.eval()

    def backbone_output() -> BatchFeature:
        return BatchFeature(
            data={
                "backbone_features": x["features"].clone(),
                "backbone_attention_mask": x["valid"],
                "image_mask": x["is_image"],
            }
        )

    action_input = BatchFeature(
        data={
            "state": x["state"][:, None],
            "action": x["action"],
            "action_mask": x["action_mask"],
            "embodiment_id": x["embodiment_id"],
        }
    )
    with (
        mock.patch.object(head, "sample_time", lambda b, device, dtype: x["time"]),
        mock.patch("torch.randn", lambda *a, **k: x["noise"].clone()),
        torch.no_grad(),
    ):
        loss = head(backbone_output(), action_input)["loss"]
        predict_input = BatchFeature(
            data={"state": x["state"][:, None], "embodiment_id": x["embodiment_id"]}
        )
        actions = head.get_action(backbone_output(), predict_input)["action_pred"]
    return loss, actions


def _our_loss_and_actions(model: GrootN16, x: dict[str, torch.Tensor]):
    model.eval()
    batch = {k: x[k] for k in ("state", "action", "action_mask", "embodiment_id", "noise", "time")}
    batch["action_mask"] = batch["action_mask"].bool()
    with torch.no_grad():
        cond, state_tok = model.condition_on_features(
            x["features"], x["valid"], x["is_image"] & x["valid"], batch
        )
        loss = model.flow_matching_loss(cond, state_tok, batch)["loss"]
        actions = model.sample_actions(cond, state_tok, x["embodiment_id"], noise=x["noise"])
    return loss, actions


def _ours_from(lerobot_dir: Path) -> GrootN16:
    _, base = read_lerobot_groot(lerobot_dir)
    model = GrootN16(config_from_lerobot_groot(base))
    load_lerobot_action_head(model, lerobot_dir)
    return model


def _compare(policy: GrootPolicy, ours: GrootN16, seed: int) -> tuple[float, float]:
    x = _inputs(seed)
    ref_loss, ref_actions = _lerobot_loss_and_actions(policy, x)
    loss, actions = _our_loss_and_actions(ours, x)
    rel = ((loss - ref_loss).abs() / ref_loss.abs()).item()
    diff = (actions - ref_actions).abs().max().item()
    print(f"loss lerobot {ref_loss.item():.8f} longboat {loss.item():.8f} rel {rel:.2e}")
    print(f"actions max abs diff {diff:.2e}")
    assert rel < 1e-5
    torch.testing.assert_close(actions, ref_actions, rtol=0, atol=1e-4)
    return rel, diff


def test_lerobot_action_head_matches_ours(lerobot_dir: Path) -> None:
    """LeRobot's save_pretrained -> our loader: same loss and sampled actions."""
    policy = GrootPolicy.from_pretrained(lerobot_dir)
    _compare(policy, _ours_from(lerobot_dir), seed=0)


def _stats(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        key: {"min": -torch.rand(d, generator=gen) - 1, "max": torch.rand(d, generator=gen) + 1}
        for key, d in (("observation.state", STATE_DIM), ("action", ACTION_DIM))
    }


def _postprocessor(directory: Path):
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import (
        policy_action_to_transition,
        transition_to_policy_action,
    )

    return PolicyProcessorPipeline.from_pretrained(
        directory,
        config_filename="policy_postprocessor.json",
        to_transition=policy_action_to_transition,
        to_output=transition_to_policy_action,
    )


def test_export_loads_in_lerobot(lerobot_dir: Path, tmp_path: Path) -> None:
    """Our action head (changed after loading, as training would) -> LeRobot's format ->
    GrootPolicy.from_pretrained predicts our actions; its processors load our stats."""
    from lerobot.processor import PolicyProcessorPipeline

    ours = _ours_from(lerobot_dir)
    perturb(ours.action_head, seed=2)
    stats = _stats(3)
    out = save_lerobot_groot(
        ours, tmp_path, backbone_from=lerobot_dir, state_dim=STATE_DIM, action_dim=ACTION_DIM,
        stats=stats,
    )  # fmt: skip
    policy = GrootPolicy.from_pretrained(out)
    _compare(policy, ours, seed=4)
    saved = json.loads((out / "config.json").read_text())
    assert saved["type"] == "groot" and saved["chunk_size"] == HORIZON
    # The postprocessor maps [-1, 1] actions back with our min / max (and drops padding).
    y = torch.rand(B, HORIZON, MAX_DIM) * 2 - 1
    lo, hi = stats["action"]["min"], stats["action"]["max"]
    torch.testing.assert_close(
        _postprocessor(out)(y), (y[..., :ACTION_DIM] + 1) / 2 * (hi - lo) + lo, rtol=1e-5, atol=1e-5
    )
    pre = PolicyProcessorPipeline.from_pretrained(out, config_filename="policy_preprocessor.json")
    pack = next(s for s in pre.steps if type(s).__name__ == "GrootN17PackInputsStep")
    for key in ("observation.state", "action"):
        for stat in ("min", "max"):
            torch.testing.assert_close(pack.stats[key][stat], stats[key][stat])
    assert pack.embodiment_mapping == {"new_embodiment": 0}


def test_trained_run_exports_to_lerobot(lerobot_dir: Path, tmp_path: Path) -> None:
    """A groot_n1_6_tiny run trained 20 steps and exported with train.lerobot_export
    (--lerobot-backbone): LeRobot's from_pretrained predicts our actions from the same
    features, and its action unnormaliser inverts our training's normalisation."""
    from longboat.core.config.compose import compose_experiment
    from longboat.embodied.data import LeRobotDataset
    from longboat.embodied.models.groot_n1_6.isaac_export import export_groot
    from longboat.embodied.train.export import load_exported_policy
    from longboat.embodied.train.trainer import train

    run = tmp_path / "run"
    cfg = compose_experiment(
        "groot_n1_6_tiny",
        [
            f"output_dir={run}",
            "train.steps=20",
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
    assert len(losses) == 20
    print(f"trained 20 steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    out = export_groot(
        run / "export", tmp_path / "lerobot", dataset=run / "dataset", lerobot_backbone=lerobot_dir
    )
    ours = load_exported_policy(run / "export").float()
    policy = GrootPolicy.from_pretrained(out)
    _compare(policy, ours, seed=5)
    ds = LeRobotDataset(run / "dataset", normalization={"action": "min_max"})
    raw = torch.as_tensor(ds._columns["action"][:4], dtype=torch.float32)
    normalised = ds.normalizer.normalize("action", raw).float()
    torch.testing.assert_close(_postprocessor(out)(normalised), raw, rtol=1e-5, atol=1e-5)
