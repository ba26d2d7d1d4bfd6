"""pi0.5 in LeRobot's policy format without lerobot installed: the key mapping round trip,
the names and shapes LeRobot 0.6.1 writes (a committed artifact), mismatch errors, the
processor files and ``model.init_from`` in a training run. Parity with LeRobot's own
forward pass: ``tests/lerobot_parity`` (``nox -s lerobot_parity``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from embodied_testkit import write_tiny_tokenizer
from safetensors.torch import load_file, save_file

from longboat.core.checkpoint import CheckpointError
from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.embodied.models.init_from import resolve_model_config
from longboat.embodied.models.pi05.lerobot_export import export_lerobot_pi05
from longboat.embodied.models.pi05.lerobot_format import (
    config_from_lerobot,
    lerobot_config_for,
    load_lerobot_pi05,
    save_lerobot_pi05,
    to_lerobot_state_dict,
)
from longboat.embodied.models.pi05.lerobot_processors import save_lerobot_processors
from longboat.embodied.models.pi05.model import Pi05
from longboat.embodied.train.export import load_exported_policy
from longboat.embodied.train.trainer import train

ARTIFACT = Path(__file__).parent / "test_data_lerobot_artifacts" / "pi05_tiny_lerobot_0.6.1"
CAMS = ["observation.images.top", "observation.images.wrist"]


def _random_model(seed: int = 0) -> Pi05:
    """The artifact's architecture with every weight random (zero-init ones included)."""
    torch.manual_seed(seed)
    model = Pi05(config_from_lerobot(json.loads((ARTIFACT / "config.json").read_text())))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def _write(model: Pi05, directory: Path) -> Path:
    cfg = lerobot_config_for(model, state_dim=6, action_dim=5, camera_keys=CAMS)
    return save_lerobot_pi05(model, directory, cfg)


def test_writer_matches_lerobot_names_and_shapes() -> None:
    want = json.loads((ARTIFACT / "keys.json").read_text())
    got = {k: list(v.shape) for k, v in to_lerobot_state_dict(_random_model()).items()}
    assert got == want


def test_reads_lerobot_config() -> None:
    raw = json.loads((ARTIFACT / "config.json").read_text())
    cfg = config_from_lerobot(raw)
    assert (cfg.llm.hidden_size, cfg.llm.num_layers, cfg.llm.vocab_size) == (64, 4, 1024)
    assert (cfg.expert.hidden_size, cfg.expert.intermediate_size) == (32, 64)
    assert (cfg.vision.hidden_size, cfg.vision.pos_grid) == (64, (4, 4))
    assert (cfg.num_cameras, cfg.action_dim, cfg.action_horizon) == (3, 8, 10)
    assert cfg.input_image_size() == (56, 56) and cfg.image.crop_fraction == 1.0
    assert cfg.max_token_len - cfg.max_state_dim == raw["tokenizer_max_length"]
    full = config_from_lerobot(
        {**raw, "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m",
         "image_resolution": [224, 224]}
    )  # fmt: skip
    assert (full.vision.hidden_size, full.vision.num_layers, full.vision.pos_grid) == (
        1152, 27, (16, 16),
    )  # fmt: skip
    assert (full.llm.hidden_size, full.llm.vocab_size, full.expert.hidden_size) == (
        2048, 257152, 1024,
    )  # fmt: skip
    back = lerobot_config_for(
        Pi05(cfg), state_dim=6, action_dim=5, camera_keys=CAMS, base=raw
    )  # the config LeRobot wrote comes back field for field
    assert back == raw


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    model = _random_model(seed=1)
    _write(model, tmp_path)
    loaded, _ = load_lerobot_pi05(tmp_path)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    gen = torch.Generator().manual_seed(0)
    batch = {
        "images": torch.rand(2, 3, 3, 56, 56, generator=gen),
        "image_mask": torch.tensor([[True, True, False]] * 2),
        "input_ids": torch.randint(0, 700, (2, 12), generator=gen),
        "attention_mask": torch.ones(2, 12, dtype=torch.bool),
        "state": torch.rand(2, 8, generator=gen) * 2 - 1,
    }
    noise = torch.randn(2, 10, 8, generator=gen)
    model.eval(), loaded.eval()
    assert torch.equal(
        model.predict_action(batch, noise=noise), loaded.predict_action(batch, noise=noise)
    )


def test_mismatch_names_missing_unexpected_and_misshaped_keys(tmp_path: Path) -> None:
    _write(_random_model(), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    gone = "model.action_out_proj.bias"
    bent = "model.paligemma_with_expert.gemma_expert.model.layers.2.mlp.up_proj.weight"
    extra = "model.state_proj.weight"
    del state[gone]
    state[bent] = torch.zeros(65, 32)
    state[extra] = torch.zeros(32, 8)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_lerobot_pi05(tmp_path)
    text = str(err.value)
    assert f"1 missing: {gone}" in text
    assert f"1 unexpected: {extra}" in text
    assert f"1 mis-shaped: {bent}: (65, 32) in the file, (64, 32) expected" in text
    # model.init_from checks the same before the dataset opens or the model is built.
    with pytest.raises(CheckpointError, match=re.escape("1 mis-shaped")):
        resolve_model_config("pi05", "tiny", {}, str(tmp_path))


def test_a_config_of_other_shapes_is_refused_by_key(tmp_path: Path) -> None:
    _write(_random_model(), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["action_expert_variant"] = "longboat_tiny_vlm"  # weights are the 32-wide expert's
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as err:
        resolve_model_config("pi05", "tiny", {}, str(tmp_path))
    assert "gemma_expert.model.layers.0.self_attn.q_proj.weight: (128, 32) in the file" in str(
        err.value
    )


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"paligemma_variant": "gemma_7b"}, "paligemma_variant='gemma_7b' is not one of"),
        ({"type": "act"}, "is a 'act' policy, not 'pi05'"),
        ({"image_resolution": [224, 160]}, "must be a square"),
        ({"use_relative_actions": True}, "use_relative_actions=true is not supported"),
    ],
)
def test_bad_lerobot_configs_are_config_errors(tmp_path: Path, change: dict, needle: str) -> None:
    raw = json.loads((ARTIFACT / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ConfigError, match=re.escape("model.init_from")) as err:
        resolve_model_config("pi05", "tiny", {}, str(tmp_path))
    assert needle in str(err.value)


def test_init_from_needs_a_policy_directory_and_pi05(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("config.json does not exist")):
        resolve_model_config("pi05", "tiny", {}, str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape("groot_n1_6 only, not model.name='act'")):
        resolve_model_config("act", "tiny", {}, str(tmp_path))


def test_processor_files_carry_the_stats(tmp_path: Path) -> None:
    model = _random_model()
    cfg = lerobot_config_for(model, state_dim=6, action_dim=5, camera_keys=CAMS)
    stats = {
        k: {s: torch.arange(d, dtype=torch.float32) + i for i, s in enumerate(
            ("mean", "std", "min", "max", "q01", "q99"))}
        for k, d in (("observation.state", 6), ("action", 5))
    }  # fmt: skip
    save_lerobot_processors(tmp_path, cfg, stats)
    pre = json.loads((tmp_path / "policy_preprocessor.json").read_text())
    names = [s["registry_name"] for s in pre["steps"]]
    assert names[3] == "normalizer_processor" and "tokenizer_processor" in names
    tensors = load_file(str(tmp_path / pre["steps"][3]["state_file"]))
    assert torch.equal(tensors["action.q99"], stats["action"]["q99"])
    assert tensors["observation.state.q01"].shape == (6,)
    post = json.loads((tmp_path / "policy_postprocessor.json").read_text())
    assert post["steps"][0]["config"]["features"] == {"action": {"type": "ACTION", "shape": [5]}}
    bad = {**stats, "action": {**stats["action"], "q01": torch.zeros(4)}}
    with pytest.raises(ConfigError, match=re.escape("action.q01 has 4 values, the feature 5")):
        save_lerobot_processors(tmp_path / "bad", cfg, bad)


def test_training_starts_from_a_lerobot_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """model.init_from: the run's step-0 weights are the checkpoint's; the export loads."""
    ckpt = _write(_random_model(seed=2), tmp_path / "ckpt")
    tokenizer = write_tiny_tokenizer(tmp_path / "tokenizer")
    cfg = compose_experiment(
        "pi05_tiny",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.init_from={ckpt}",
            f"model.tokenizer={tokenizer}",
            "train.steps=1",
            "train.micro_batch_size=2",
            "train.global_batch_size=null",
            "optim.lr=0.0",
            "logging.progress=false",
            "logging.trackers=[]",
            "data.synthetic.num_episodes=2",
            "data.synthetic.episode_length=12",
        ],
        world_size=1,
    )
    result = train(cfg)
    assert len(result.losses) == 1 and torch.isfinite(torch.tensor(result.losses)).all()
    # The start line names the checkpoint, not model.flavor (whose architecture is unused).
    started = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Policy ")]
    assert started[0].startswith(f"Policy pi05 from {ckpt} (its architecture and weights): ")
    exported = load_exported_policy(tmp_path / "run" / "export")
    reference, _ = load_lerobot_pi05(ckpt)
    for key, value in reference.state_dict().items():
        assert torch.equal(exported.state_dict()[key].float(), value), key
    # ... and goes back out in LeRobot's format with the dataset's min / max.
    dataset = tmp_path / "run" / "dataset"
    out = export_lerobot_pi05(tmp_path / "run" / "export", tmp_path / "out", dataset=dataset)
    again, cfg = load_lerobot_pi05(out)
    for key, value in again.state_dict().items():
        assert torch.equal(exported.state_dict()[key].float(), value), key
    assert cfg["normalization_mapping"]["ACTION"] == "MIN_MAX"
    assert cfg["input_features"]["observation.state"]["shape"] == [
        json.loads((dataset / "meta" / "info.json").read_text())["features"]["observation.state"][
            "shape"
        ][0]
    ]
    stats = json.loads((dataset / "meta" / "stats.json").read_text())
    post = load_file(str(out / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"))
    assert post["action.max"].tolist() == torch.tensor(stats["action"]["max"]).float().tolist()
