"""Parity with LeRobot's own pi0.5 (lerobot 0.6.1): run by ``nox -s lerobot_parity``.

lerobot cannot join the workspace lock (it pins torch<2.12, numpy<2.3, transformers<5.6), so
this module is skipped where lerobot is not installed (the default run). The nox session
installs lerobot[pi]==0.6.1 next to the built longboat wheels in a fresh venv.

LeRobot builds only the gemma_2b / gemma_300m shapes with SigLIP So400m and PaliGemma's
257152-token vocabulary; ``tiny_lerobot`` patches three names of its pi05 module for the
test (the variant table, the PaliGemma constructor's vision / vocab sizes, and the
config's variant check) so it builds our tiny flavor. Nothing is downloaded: the PaliGemma
tokenizer (a Hub download in LeRobot's preprocessor) is never constructed where token ids go
in directly; the end-to-end test tokenises with a tiny local tokenizer instead, through
LeRobot's own preprocessor and longboat's collator alike.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("lerobot", reason="lerobot is installed only by `nox -s lerobot_parity`")

from lerobot.configs import FeatureType, PolicyFeature
from lerobot.policies.pi05 import modeling_pi05
from lerobot.policies.pi05.configuration_pi05 import PI05Config
from lerobot.policies.pi05.modeling_pi05 import PI05Policy
from lerobot_parity_kit import lerobot_loss_and_actions, our_loss_and_actions, perturb

from longboat.embodied.models.pi05.lerobot_format import (
    GEMMA_VARIANTS,
    lerobot_config_for,
    load_lerobot_pi05,
    save_lerobot_pi05,
)
from longboat.embodied.models.pi05.lerobot_processors import save_lerobot_processors

pytestmark = pytest.mark.lerobot

TINY = ("longboat_tiny_vlm", "longboat_tiny_expert")
CAMS = ["observation.images.top", "observation.images.wrist"]
STATE_DIM, ACTION_DIM, B = 6, 5, 2
TRAIN_STEPS = 20  # the end-to-end case: LeRobot in, 20 steps, LeRobot out

_orig_get = modeling_pi05.get_gemma_config
_orig_paligemma = modeling_pi05.PaliGemmaForConditionalGenerationWithPiGemma
_orig_post_init = PI05Config.__post_init__


def _get_gemma_config(variant: str):
    if variant in TINY:
        w, depth, mlp, heads, kv, hd = GEMMA_VARIANTS[variant]
        return modeling_pi05.GemmaConfig(w, depth, mlp, heads, kv, hd)
    return _orig_get(variant)


def _paligemma(config):
    if config.text_config.hidden_size == GEMMA_VARIANTS["longboat_tiny_vlm"][0]:
        v = config.vision_config  # our tiny ViT; LeRobot fixes So400m and a 2048 projection
        v.hidden_size, v.num_hidden_layers, v.num_attention_heads = 64, 2, 4
        v.intermediate_size, v.projection_dim = 128, 64
        config.text_config.vocab_size = 1024
    return _orig_paligemma(config=config)


def _post_init(self) -> None:
    saved = self.paligemma_variant, self.action_expert_variant
    self.paligemma_variant = "gemma_300m" if saved[0] in TINY else saved[0]
    self.action_expert_variant = "gemma_300m" if saved[1] in TINY else saved[1]
    try:
        _orig_post_init(self)
    finally:
        self.paligemma_variant, self.action_expert_variant = saved


@contextlib.contextmanager
def tiny_lerobot():
    """LeRobot's pi05 with our tiny variants known (construction and from_pretrained)."""
    with (
        mock.patch.object(modeling_pi05, "get_gemma_config", _get_gemma_config),
        mock.patch.object(
            modeling_pi05, "PaliGemmaForConditionalGenerationWithPiGemma", _paligemma
        ),
        mock.patch.object(PI05Config, "__post_init__", _post_init),
    ):
        yield


def _lerobot_config() -> PI05Config:
    return PI05Config(
        paligemma_variant=TINY[0],
        action_expert_variant=TINY[1],
        chunk_size=10,
        n_action_steps=10,
        max_state_dim=8,
        max_action_dim=8,
        image_resolution=(56, 56),
        tokenizer_max_length=40,
        empty_cameras=1,  # a third, masked camera slot
        input_features={
            **{k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, 56, 56)) for k in CAMS},
            "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,)),
        },
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))},
        device="cpu",
    )


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    length = 24
    tokens = torch.randint(0, 1024, (B, length), generator=gen)
    mask = torch.ones(B, length, dtype=torch.bool)
    mask[1, 17:] = False  # a shorter prompt: padding inside the prefix
    return {
        "images": torch.rand(B, len(CAMS), 3, 56, 56, generator=gen),
        "tokens": tokens,
        "mask": mask,
        "action": torch.randn(B, 10, ACTION_DIM, generator=gen),
        "noise": torch.randn(B, 10, 8, generator=gen),
        "time": torch.rand(B, generator=gen) * 0.9 + 0.05,
    }


def _lerobot_batch(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    batch = {k: x["images"][:, i] for i, k in enumerate(CAMS)}
    batch["observation.language.tokens"] = x["tokens"]
    batch["observation.language.attention_mask"] = x["mask"]
    batch["observation.state"] = torch.zeros(B, STATE_DIM)  # read by the tokenizer step only
    batch["action"] = x["action"]
    return batch


def _our_batch(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    n_slots = len(CAMS) + 1
    images = torch.zeros(B, n_slots, 3, 56, 56)
    images[:, : len(CAMS)] = x["images"]
    image_mask = torch.zeros(B, n_slots, dtype=torch.bool)
    image_mask[:, : len(CAMS)] = True
    action = torch.zeros(B, 10, 8)
    action[..., :ACTION_DIM] = x["action"]
    action_mask = torch.zeros(1, 1, 8, dtype=torch.bool)
    action_mask[..., :ACTION_DIM] = True
    return {
        "images": images,
        "image_mask": image_mask,
        "input_ids": x["tokens"],
        "attention_mask": x["mask"],
        # LeRobot spells the state in the prompt; here it is in the given tokens already.
        "state": torch.zeros(B, 8),
        "state_mask": torch.zeros(B, 8, dtype=torch.bool),
        "action": action,
        "action_mask": action_mask,
        "noise": x["noise"],
        "time": x["time"],
    }


def _lerobot_loss_and_actions(policy: PI05Policy, x: dict[str, torch.Tensor]):
    return lerobot_loss_and_actions(policy, lambda: _lerobot_batch(x), x["noise"], x["time"])


def _our_loss_and_actions(model: torch.nn.Module, x: dict[str, torch.Tensor]):
    return our_loss_and_actions(model, _our_batch(x), x["noise"], ACTION_DIM)


@pytest.fixture(scope="module")
def lerobot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LeRobot-saved tiny pi0.5 with random weights."""
    out = tmp_path_factory.mktemp("lerobot_pi05")
    torch.manual_seed(0)
    with tiny_lerobot():
        policy = PI05Policy(_lerobot_config())
    perturb(policy, seed=1)
    policy.save_pretrained(out)
    return out


def test_init_from_lerobot_matches_lerobot(lerobot_dir: Path) -> None:
    """LeRobot's save_pretrained -> our loader: same training loss and sampled actions."""
    torch.set_default_dtype(torch.float32)
    with tiny_lerobot():
        policy = PI05Policy.from_pretrained(lerobot_dir)
    ours, _ = load_lerobot_pi05(lerobot_dir)
    x = _inputs()
    ref_loss, ref_actions = _lerobot_loss_and_actions(policy, x)
    loss, actions = _our_loss_and_actions(ours, x)
    rel = (loss - ref_loss).abs() / ref_loss.abs()
    print(f"loss lerobot {ref_loss.item():.8f} longboat {loss.item():.8f} rel {rel.item():.2e}")
    print(f"actions max abs diff {(actions - ref_actions).abs().max().item():.2e}")
    assert rel.item() < 1e-5
    torch.testing.assert_close(actions, ref_actions, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "sizes", [((96, 64), (48, 48)), ((120, 160), (120, 160)), ((72, 72), (72, 72))]
)
def test_frames_of_other_sizes_give_lerobots_loss_and_actions(
    lerobot_dir: Path, sizes: tuple[tuple[int, int], ...]
) -> None:
    """Camera frames not at the model's 56x56, raw into LeRobot's policy (it resizes each
    inside) and through longboat's path: cameras of different sizes resized per camera by
    the collator (fit_frames), cameras of one size by the model's own preprocessing. The
    same loss and actions: the frames are resized alike (72 -> 55 rows, one short)."""
    from longboat.embodied.train.policy_batch import batch_spec, fit_frames

    with tiny_lerobot():
        policy = PI05Policy.from_pretrained(lerobot_dir)
    ours, _ = load_lerobot_pi05(lerobot_dir)
    x = _inputs(seed=6)
    gen = torch.Generator().manual_seed(7)
    frames = [torch.rand(B, 3, *hw, generator=gen) for hw in sizes]
    batch = _lerobot_batch(x)
    batch.update(zip(CAMS, frames, strict=True))
    policy.eval()
    with (
        mock.patch.object(policy.model, "sample_noise", lambda shape, device: x["noise"]),
        mock.patch.object(policy.model, "sample_time", lambda b, device: x["time"]),
    ):
        ref_loss, _ = policy.forward(dict(batch))
        ref_actions = policy.predict_action_chunk(dict(batch))

    if len(set(sizes)) > 1:  # the collator's per-camera resize
        spec = batch_spec("pi05", ours.cfg, len(CAMS), sizes[0], resize_cameras=True)
        images = torch.stack([fit_frames(f, spec) for f in frames], dim=1)
    else:  # one size: the frames reach the model as read
        images = torch.stack(frames, dim=1)
    mine = _our_batch({**x, "images": torch.zeros(B, len(CAMS), 3, 56, 56)})
    n_slots = mine["images"].shape[1]
    mine["images"] = torch.zeros(B, n_slots, 3, *images.shape[-2:])
    mine["images"][:, : len(CAMS)] = images
    ours.eval()
    with torch.no_grad():
        loss = ours(mine)["loss"]
        actions = ours.predict_action(mine, noise=x["noise"])[..., :ACTION_DIM]
    rel = ((loss - ref_loss).abs() / ref_loss.abs()).item()
    diff = (actions - ref_actions).abs().max().item()
    print(f"frames {sizes}: loss rel {rel:.2e}, actions max abs diff {diff:.2e}")
    assert rel < 1e-5
    torch.testing.assert_close(actions, ref_actions, rtol=0, atol=1e-4)


def test_export_loads_in_lerobot(lerobot_dir: Path, tmp_path: Path) -> None:
    """Our weights (changed after loading, as training would) -> LeRobot format ->
    LeRobot's from_pretrained predicts our actions; its processors load our stats."""
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import (
        policy_action_to_transition,
        transition_to_policy_action,
    )

    ours, base = load_lerobot_pi05(lerobot_dir)
    perturb(ours, seed=2)
    cfg = lerobot_config_for(
        ours, state_dim=STATE_DIM, action_dim=ACTION_DIM, camera_keys=CAMS, base=base
    )
    save_lerobot_pi05(ours, tmp_path, cfg)
    gen = torch.Generator().manual_seed(3)
    stats = {
        key: {
            "mean": torch.randn(d, generator=gen),
            "std": torch.rand(d, generator=gen) + 0.5,
            "min": -torch.rand(d, generator=gen) - 1,
            "max": torch.rand(d, generator=gen) + 1,
            "q01": -torch.rand(d, generator=gen) - 0.5,
            "q99": torch.rand(d, generator=gen) + 0.5,
        }
        for key, d in (("observation.state", STATE_DIM), ("action", ACTION_DIM))
    }
    save_lerobot_processors(tmp_path, cfg, stats)
    with tiny_lerobot():
        policy = PI05Policy.from_pretrained(tmp_path)
    x = _inputs(seed=4)
    ref_loss, ref_actions = _lerobot_loss_and_actions(policy, x)
    loss, actions = _our_loss_and_actions(ours, x)
    assert ((loss - ref_loss).abs() / ref_loss.abs()).item() < 1e-5
    torch.testing.assert_close(actions, ref_actions, rtol=0, atol=1e-4)

    # The postprocessor LeRobot loads maps normalised actions back with our q01 / q99.
    post = PolicyProcessorPipeline.from_pretrained(
        tmp_path,
        config_filename="policy_postprocessor.json",
        to_transition=policy_action_to_transition,
        to_output=transition_to_policy_action,
    )
    y = torch.rand(B, ACTION_DIM) * 2 - 1
    out = post(y)
    q01, q99 = stats["action"]["q01"], stats["action"]["q99"]
    torch.testing.assert_close(out, (y + 1) / 2 * (q99 - q01) + q01, rtol=1e-5, atol=1e-5)
    # The preprocessor's normaliser holds the same stats (its tokenizer step would fetch
    # google/paligemma-3b-pt-224 from the Hub; a stand-in tokenizer replaces that here).
    from lerobot.processor import tokenizer_processor

    with mock.patch.object(
        tokenizer_processor.AutoTokenizer, "from_pretrained", lambda *a, **k: object()
    ):
        pre = PolicyProcessorPipeline.from_pretrained(
            tmp_path, config_filename="policy_preprocessor.json"
        )
    norm = next(s for s in pre.steps if type(s).__name__ == "NormalizerProcessorStep")
    state = norm.state_dict()
    for key in ("observation.state", "action"):
        for stat in ("q01", "q99", "mean", "std"):
            torch.testing.assert_close(state[f"{key}.{stat}"], stats[key][stat])
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["paligemma_variant"] == TINY[0] and saved["chunk_size"] == 10


def test_trained_run_exports_to_lerobot(lerobot_dir: Path, tmp_path: Path) -> None:
    """A longboat run started from the LeRobot checkpoint (model.init_from) with a local
    tokenizer (model.tokenizer), trained 20 steps, writes its LeRobot directory itself
    (export.format=auto). LeRobot's own preprocessor, loaded from it, tokenises the raw
    samples' prompts exactly as longboat's collator did (the same ids and mask, its
    normaliser the same state), and LeRobot's from_pretrained predicts our actions from it."""
    from embodied_testkit import write_tiny_tokenizer
    from lerobot.processor.converters import batch_to_transition, transition_to_batch
    from lerobot.processor.pipeline import PolicyProcessorPipeline

    from longboat.core.config.compose import compose_experiment
    from longboat.embodied.data import LeRobotDataset
    from longboat.embodied.models.pi05.lerobot_processors import preprocessor_overrides
    from longboat.embodied.models.pi05.processor import PromptTokenizer
    from longboat.embodied.train.export import load_exported_policy
    from longboat.embodied.train.trainer import train

    tokenizer = write_tiny_tokenizer(tmp_path / "tokenizer")
    run = tmp_path / "run"
    cfg = compose_experiment(
        "pi05_tiny",
        [
            f"output_dir={run}",
            f"model.init_from={lerobot_dir}",
            f"model.tokenizer={tokenizer}",
            f"train.steps={TRAIN_STEPS}",
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
    assert len(losses) == TRAIN_STEPS
    print(f"trained {TRAIN_STEPS} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    out = run / "export" / "lerobot"
    ours = load_exported_policy(run / "export")
    with tiny_lerobot():
        policy = PI05Policy.from_pretrained(out)
    moved = sum(
        (a.float() - b.float()).abs().sum().item()
        for a, b in zip(
            ours.state_dict().values(),
            load_lerobot_pi05(lerobot_dir)[0].state_dict().values(),
            strict=True,
        )
    )
    assert moved > 0  # training changed the weights

    # Raw samples of the run's dataset through LeRobot's preprocessor (its tokenizer step
    # loads the export's tokenizer/ folder: nothing is stubbed or downloaded).
    pre = PolicyProcessorPipeline.from_pretrained(
        out,
        config_filename="policy_preprocessor.json",
        overrides=preprocessor_overrides(out),  # its relative tokenizer_name, from any cwd
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
    ids, mask = PromptTokenizer(tokenizer, ours.cfg.prompt_length())(
        [s["task"] for s in samples], [s["observation.state"] for s in samples]
    )
    assert torch.equal(theirs["observation.language.tokens"].cpu(), ids)
    assert torch.equal(theirs["observation.language.attention_mask"].cpu().bool(), mask)
    torch.testing.assert_close(
        theirs["observation.state"].float(),
        torch.stack([s["observation.state"] for s in samples]).float(),
        rtol=1e-5,
        atol=1e-5,
    )

    b = len(rows)
    noise = torch.randn(b, 10, 8, generator=torch.Generator().manual_seed(5))
    policy.eval()
    with mock.patch.object(policy.model, "sample_noise", lambda shape, device: noise):
        ref = policy.predict_action_chunk(theirs)
    n_slots = ours.cfg.num_cameras
    images = torch.zeros(b, n_slots, 3, 56, 56)
    image_mask = torch.zeros(b, n_slots, dtype=torch.bool)
    for i, k in enumerate(cams):
        images[:, i], image_mask[:, i] = raw[k], True
    ours.eval()
    got = ours.predict_action(
        {
            "images": images,
            "image_mask": image_mask,
            "input_ids": ids,
            "attention_mask": mask,
            "state": torch.zeros(b, ours.cfg.max_state_dim),
        },
        noise=noise,
    )[..., : ref.shape[-1]]
    print(f"actions max abs diff {(got - ref).abs().max().item():.2e}")
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
