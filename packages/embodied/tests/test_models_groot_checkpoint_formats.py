"""GR00T N1.6 checkpoints in and out without Isaac-GR00T or lerobot installed: the
Isaac-GR00T N1.6 key mapping round trip, the names and shapes it uses, SigLIP2's linear
patch embedding against our Conv2d, config reading, mismatch errors, a LeRobot groot
(N1.7) directory refused by key and its action head loaded, and ``model.init_from`` in a
training run. Parity with LeRobot's forward pass: ``tests/lerobot_parity``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from longboat.core.checkpoint import CheckpointError
from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.embodied.models.groot_n1_6 import config as groot_config
from longboat.embodied.models.groot_n1_6.isaac_export import export_groot
from longboat.embodied.models.groot_n1_6.isaac_format import (
    config_from_isaac,
    isaac_config_for,
    load_isaac_groot,
    save_isaac_groot,
)
from longboat.embodied.models.groot_n1_6.lerobot_format import (
    ACTION_HEAD_PREFIX,
    config_from_lerobot_groot,
    load_lerobot_action_head,
    to_lerobot_action_head,
)
from longboat.embodied.models.groot_n1_6.model import GrootN16
from longboat.embodied.models.groot_n1_6.weight_names import (
    ISAAC_PATCH_WEIGHT,
    conv_to_linear_patch,
    to_isaac,
)
from longboat.embodied.models.init_from import resolve_model_config
from longboat.embodied.train.export import load_exported_policy
from longboat.embodied.train.trainer import train

# Gr00tN1d6Config's defaults (Isaac-GR00T N1.6), the fields that shape the model.
ISAAC_DEFAULTS = {
    "model_type": "Gr00tN1d6",
    "model_name": "nvidia/Eagle-Block2A-2B-v2",
    "select_layer": 16,
    "backbone_embedding_dim": 2048,
    "tune_top_llm_layers": 4,
    "load_bf16": True,
    "shortest_image_edge": 256,
    "crop_fraction": 0.95,
    "max_state_dim": 29,
    "max_action_dim": 29,
    "action_horizon": 16,
    "hidden_size": 1024,
    "input_embedding_dim": 1536,
    "add_pos_embed": True,
    "use_vlln": True,
    "max_seq_len": 1024,
    "use_alternate_vl_dit": True,
    "attend_text_every_n_blocks": 2,
    "diffusion_model_cfg": {
        "positional_embeddings": None,
        "num_layers": 32,
        "num_attention_heads": 32,
        "attention_head_dim": 48,
        "norm_type": "ada_norm",
        "dropout": 0.2,
        "final_dropout": True,
        "output_dim": 1024,
        "interleave_self_attention": True,
    },
    "num_inference_timesteps": 4,
    "noise_beta_alpha": 1.5,
    "noise_beta_beta": 1.0,
    "noise_s": 0.999,
    "num_timestep_buckets": 1000,
    "state_dropout_prob": 0.0,
    "max_num_embodiments": 32,
}


def _random_model(seed: int = 0, **changes) -> GrootN16:
    torch.manual_seed(seed)
    cfg = groot_config.tiny()
    for k, v in changes.items():
        setattr(cfg, k, v)
    model = GrootN16(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "images": torch.rand(2, 2, 3, 56, 84, generator=gen),
        "input_ids": torch.randint(0, 500, (2, 7), generator=gen),
        "attention_mask": torch.tensor([[1] * 7, [1] * 5 + [0] * 2]),
        "state": torch.rand(2, 8, generator=gen) * 2 - 1,
        "embodiment_id": torch.tensor([0, 3]),
    }


def test_isaac_round_trip_is_bit_exact(tmp_path: Path) -> None:
    model = _random_model(seed=1)
    save_isaac_groot(model, tmp_path, isaac_config_for(model))
    loaded, raw = load_isaac_groot(tmp_path)
    assert loaded.cfg == model.cfg and raw["model_type"] == "Gr00tN1d6"
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    noise = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(2))
    model.eval(), loaded.eval()
    assert torch.equal(
        model.predict_action(_batch(), noise=noise), loaded.predict_action(_batch(), noise=noise)
    )


def test_isaac_names_and_shapes() -> None:
    """The names Isaac-GR00T N1.6's modules give (Eagle3_VL: vision_model / mlp1 /
    language_model; the action head's DiT as diffusers blocks), for the tiny shapes."""
    got = {k: tuple(v.shape) for k, v in to_isaac(_random_model()).items()}
    v, lm = "backbone.model.vision_model.vision_model.", "backbone.model.language_model.model."
    ah = "action_head."
    want = {
        v + "embeddings.patch_embedding.weight": (64, 14 * 14 * 3),
        v + "embeddings.position_embedding.weight": (24, 64),
        v + "encoder.layers.1.self_attn.k_proj.bias": (64,),
        v + "encoder.layers.0.mlp.fc1.weight": (128, 64),
        v + "post_layernorm.weight": (64,),
        "backbone.model.mlp1.0.weight": (256,),
        "backbone.model.mlp1.1.weight": (64, 256),
        "backbone.model.mlp1.3.bias": (64,),
        lm + "embed_tokens.weight": (512, 64),
        lm + "layers.2.self_attn.q_norm.weight": (16,),
        lm + "layers.2.self_attn.k_proj.weight": (32, 64),
        lm + "layers.0.post_attention_layernorm.weight": (64,),
        ah + "vlln.bias": (64,),
        ah + "state_encoder.layer1.W": (4, 8, 32),
        ah + "action_encoder.W2.W": (4, 128, 64),
        ah + "action_decoder.layer2.b": (4, 8),
        ah + "position_embedding.weight": (32, 64),
        ah + "model.timestep_encoder.timestep_embedder.linear_1.weight": (64, 256),
        ah + "model.transformer_blocks.0.norm1.linear.weight": (128, 64),
        ah + "model.transformer_blocks.0.attn1.to_k.weight": (64, 64),
        ah + "model.transformer_blocks.1.attn1.to_k.weight": (64, 64),
        ah + "model.transformer_blocks.2.attn1.to_out.0.bias": (64,),
        ah + "model.transformer_blocks.3.ff.net.0.proj.weight": (256, 64),
        ah + "model.transformer_blocks.3.ff.net.2.weight": (64, 256),
        ah + "model.proj_out_2.weight": (32, 64),
        lm + "norm.weight": (64,),  # the features are this norm of the last kept layer
    }
    for key, shape in want.items():
        assert got.get(key) == shape, key
    assert not any(k.startswith(lm + "layers.3.") for k in got)  # select_layer=3: 3 layers
    assert not any("lm_head" in k for k in got)
    assert len(got) == 159


# nvidia/GR00T-N1.6-3B's model.safetensors (its config.json: max_state_dim = max_action_dim
# = 128): tensors and millions of parameters per prefix, 1106 tensors in all, as listed from
# the released file.
RELEASE_TENSORS = {
    "action_head.action_decoder": (4, 37.8),
    "action_head.action_encoder": (6, 232.9),
    "action_head.model": (456, 1091.7),
    "action_head.position_embedding": (1, 1.6),
    "action_head.state_encoder": (4, 54.6),
    "action_head.vlln": (2, 0.0),
    "backbone.model.language_model": (179, 1426.7),
    "backbone.model.mlp1": (6, 13.6),
    "backbone.model.vision_model": (448, 427.7),
}


def test_the_release_layout_holds_the_released_tensors() -> None:
    """The full flavor read from the release's config writes every tensor of the released
    file but the two parts read past (the tied LM head; SigLIP2's pooling head, 11 tensors),
    with the same parameter counts per prefix (to the 0.1M the listing gives)."""
    cfg = config_from_isaac({**ISAAC_DEFAULTS, "max_state_dim": 128, "max_action_dim": 128})
    with torch.device("meta"):
        model = GrootN16(cfg)
    counts: dict[str, list[int]] = {k: [0, 0] for k in RELEASE_TENSORS}
    for key, value in to_isaac(model).items():
        prefix = next(p for p in RELEASE_TENSORS if key.startswith(p + "."))
        counts[prefix][0] += 1
        counts[prefix][1] += value.numel()
    vision, vocab, width = cfg.vision.hidden_size, cfg.llm.vocab_size, cfg.llm.hidden_size
    mlp = cfg.vision.intermediate_size
    pooling = [vision, 3 * vision * vision, 3 * vision, vision * vision, vision, vision,
               vision, mlp * vision, mlp, vision * mlp, vision]  # fmt: skip
    counts["backbone.model.vision_model"][0] += len(pooling)
    counts["backbone.model.vision_model"][1] += sum(pooling)
    counts["backbone.model.language_model"][0] += 1
    counts["backbone.model.language_model"][1] += vocab * width
    got = {k: (n, round(params / 1e6, 1)) for k, (n, params) in counts.items()}
    assert got == RELEASE_TENSORS


def test_siglip2_linear_patch_embedding_equals_our_conv() -> None:
    """SigLIP2 embeds (row, col, channel)-ordered patches with a Linear; the converted
    weight gives our Conv2d's output (fp32, 1e-5)."""
    model = _random_model(seed=3)
    conv = model.backbone.vision.patch_embed
    pixels = torch.randn(2, 3, 56, 84, generator=torch.Generator().manual_seed(4))
    ours = conv(pixels).flatten(2).transpose(1, 2)
    p = 14
    patches = pixels.reshape(2, 3, 4, p, 6, p).permute(0, 2, 4, 3, 5, 1).reshape(2, 24, -1)
    weight = to_isaac(model)[ISAAC_PATCH_WEIGHT]
    torch.testing.assert_close(weight, conv_to_linear_patch(conv.weight.detach()))
    theirs = patches @ weight.T + conv.bias.detach()
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_reads_the_release_config() -> None:
    cfg = config_from_isaac(ISAAC_DEFAULTS)
    full = groot_config.full()
    assert (cfg.vision, cfg.llm, cfg.image_token_id) == (full.vision, full.llm, 151669)
    assert (cfg.dit.num_layers, cfg.dit.num_heads, cfg.dit.head_dim) == (32, 32, 48)
    assert (cfg.dit.cross_attention_dim, cfg.dit.output_dim, cfg.dit.dropout) == (2048, 1024, 0.2)
    assert (cfg.select_layer, cfg.max_state_dim, cfg.max_action_dim) == (16, 29, 29)
    assert (cfg.action_horizon, cfg.num_embodiments, cfg.state_hidden) == (16, 32, 1024)
    assert (cfg.image.resize_shortest, cfg.image.crop_fraction, cfg.image.multiple_of) == (
        256, 0.95, 28,
    )  # fmt: skip
    assert cfg.frozen_dtype == "bfloat16" and cfg.tune_top_llm_layers == 4
    back = isaac_config_for(SimpleNamespace(cfg=cfg), base=ISAAC_DEFAULTS)
    assert {k: back[k] for k in ISAAC_DEFAULTS} == ISAAC_DEFAULTS


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"model_name": "nvidia/Eagle2-1B"}, "model_name='nvidia/Eagle2-1B' is not one of"),
        ({"use_alternate_vl_dit": False}, "use_alternate_vl_dit=False is not supported"),
        ({"backbone_embedding_dim": 1536}, "backbone_embedding_dim=1536 != the"),
        ({"hidden_size": 512}, "diffusion_model_cfg.output_dim=1024 != hidden_size=512"),
        ({"model_type": "Gr00tN1d7"}, "model_type='Gr00tN1d7'"),
    ],
)
def test_bad_release_configs_are_config_errors(tmp_path: Path, change: dict, needle: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**ISAAC_DEFAULTS, **change}))
    with pytest.raises(ConfigError, match=re.escape("model.init_from")) as err:
        resolve_model_config("groot_n1_6", "tiny", {}, str(tmp_path))
    assert needle in str(err.value)


def test_mismatch_names_missing_unexpected_and_misshaped_keys(tmp_path: Path) -> None:
    model = _random_model()
    save_isaac_groot(model, tmp_path, isaac_config_for(model))
    state = load_file(str(tmp_path / "model.safetensors"))
    gone = "action_head.model.proj_out_1.bias"
    bent = "backbone.model.language_model.model.layers.1.mlp.up_proj.weight"
    extra = "action_head.vl_self_attention.transformer_blocks.0.attn1.to_q.weight"
    del state[gone]
    state[bent] = torch.zeros(130, 64)
    state[extra] = torch.zeros(64, 64)
    state["backbone.model.language_model.lm_head.weight"] = torch.zeros(512, 64)  # read past
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        resolve_model_config("groot_n1_6", "tiny", {}, str(tmp_path))
    text = str(err.value)
    assert f"1 missing: {gone}" in text
    assert f"1 unexpected: {extra}" in text
    assert f"1 mis-shaped: {bent}: (130, 64) in the file, (128, 64) expected" in text


def test_a_config_of_other_shapes_is_refused_by_key(tmp_path: Path) -> None:
    model = _random_model()
    save_isaac_groot(model, tmp_path, isaac_config_for(model))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["select_layer"] = 4  # the file holds 3 Qwen3 layers
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"missing: .*language_model\.model\.layers\.3\."):
        resolve_model_config("groot_n1_6", "tiny", {}, str(tmp_path))


def test_sharded_release_loads(tmp_path: Path) -> None:
    model = _random_model(seed=5)
    save_isaac_groot(model, tmp_path, isaac_config_for(model))
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for k, v in state.items():
        shards[sorted(shards)[k.startswith("action_head.")]][k] = v
    weight_map = {}
    for name, part in shards.items():
        save_file(part, str(tmp_path / name))
        weight_map |= dict.fromkeys(part, name)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded, _ = load_isaac_groot(tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def _lerobot_dirs(tmp_path: Path, model: GrootN16) -> Path:
    """A LeRobot groot (N1.7) policy directory as lerobot 0.6.1 lays it out, holding our
    action head and one Qwen3-VL backbone tensor."""
    base = tmp_path / "base"
    base.mkdir()
    raw = {**isaac_config_for(model), "model_type": "Gr00tN1d7", "model_name": "Qwen/Qwen3-VL-tiny"}
    raw["vl_self_attention_cfg"] = {"num_layers": 0}
    (base / "config.json").write_text(json.dumps(raw))
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps({"type": "groot", "base_model_path": str(base)}))
    state = to_lerobot_action_head(model)
    state["_groot_model.backbone.model.model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(state, str(policy / "model.safetensors"))
    return policy


def test_lerobot_groot_is_refused_naming_its_backbone(tmp_path: Path) -> None:
    model = _random_model(seed=6)
    policy = _lerobot_dirs(tmp_path, model)
    cfg = config_from_lerobot_groot(json.loads((tmp_path / "base" / "config.json").read_text()))
    assert (cfg.dit.num_layers, cfg.state_hidden, cfg.max_action_dim) == (4, 32, 8)
    with pytest.raises(CheckpointError) as err:
        resolve_model_config("groot_n1_6", "tiny", {}, str(policy))
    text = str(err.value)
    assert "LeRobot 0.6.1's GR00T N1.7" in text
    assert "1 unexpected: _groot_model.backbone.model.model.visual.patch_embed.proj.weight" in text
    assert "its 81 action-head tensors fit" in text


def test_lerobot_action_head_loads_bit_exact(tmp_path: Path) -> None:
    source = _random_model(seed=7)
    policy = _lerobot_dirs(tmp_path, source)
    target = _random_model(seed=8)
    load_lerobot_action_head(target, policy)
    for key, value in source.state_dict().items():
        same = torch.equal(target.state_dict()[key], value)
        assert same == key.startswith("action_head."), key
    state = load_file(str(policy / "model.safetensors"))
    del state[ACTION_HEAD_PREFIX + "vlln.weight"]
    save_file(state, str(policy / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=re.escape(f"1 missing: {ACTION_HEAD_PREFIX}vlln.weight")
    ):
        load_lerobot_action_head(target, policy)


def test_training_starts_from_an_isaac_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """model.init_from: the run's step-0 weights are the checkpoint's; the export goes back
    out in the Isaac-GR00T layout."""
    model = _random_model(seed=9)
    ckpt = save_isaac_groot(model, tmp_path / "ckpt", isaac_config_for(model))
    cfg = compose_experiment(
        "groot_n1_6_tiny",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.init_from={ckpt}",
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
    out = capsys.readouterr().out.splitlines()
    started = [x for x in out if x.startswith("Policy ")]
    assert started[0].startswith(f"Policy groot_n1_6 from {ckpt} (its architecture and weights)")
    # A tiny checkpoint keeps the stand-in's bytes (the released backbone needs
    # model.tokenizer): the run says which LM reads them and how to get Isaac's prompt.
    prompts = [x for x in out if x.startswith("Prompts: ")]
    assert "read by model.init_from's language model" in prompts[0]
    assert "set model.tokenizer=<dir> (nvidia/Eagle-Block2A-2B-v2's tokenizer)" in prompts[0]
    exported = load_exported_policy(tmp_path / "run" / "export")
    for key, value in model.state_dict().items():
        assert torch.equal(exported.state_dict()[key].float(), value), key
    out = export_groot(
        tmp_path / "run" / "export", tmp_path / "out", dataset=tmp_path / "run" / "dataset"
    )
    again, raw = load_isaac_groot(out)
    assert raw["model_name"] == "longboat/eagle-tiny" and raw["select_layer"] == 3
    for key, value in again.state_dict().items():
        assert torch.equal(exported.state_dict()[key].float(), value.float()), key
