"""Wan config (diffusers config.json in and out, flavors, validation), token packing and the 3D
rotary tables against diffusers, and the family registry. No megatron needed."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformer3DModel

from longboat.core.config.errors import ConfigError
from longboat.diffusion.models import registry
from longboat.diffusion.models.wan.config import FLAVORS, WanConfig, flavor, read_config
from longboat.diffusion.models.wan.packing import (
    VideoPacking,
    pack_latents,
    patchify,
    rope_tables,
    unpack_tokens,
    unpatchify,
)

# transformer/config.json of Wan-AI/Wan2.1-T2V-1.3B-Diffusers as published.
RELEASED_1_3B = {
    "_class_name": "WanTransformer3DModel", "_diffusers_version": "0.33.0.dev0",
    "added_kv_proj_dim": None, "attention_head_dim": 128, "cross_attn_norm": True,
    "eps": 1e-06, "ffn_dim": 8960, "freq_dim": 256, "image_dim": None, "in_channels": 16,
    "num_attention_heads": 12, "num_layers": 30, "out_channels": 16, "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024, "text_dim": 4096,
}  # fmt: skip


def test_defaults_are_diffusers_defaults() -> None:
    params = inspect.signature(WanTransformer3DModel.__init__).parameters
    ours = FLAVORS["t2v_14b"].to_diffusers()  # the 14B shape is diffusers' default one
    for key, value in ours.items():
        default = params[key].default
        assert (list(default) if isinstance(default, tuple) else default) == value, key


def test_flavors() -> None:
    assert WanConfig.from_diffusers(RELEASED_1_3B) == flavor("t2v_1_3b")
    small, big = flavor("t2v_1_3b"), flavor("t2v_14b")
    assert (small.num_layers, small.hidden_size, small.num_attention_heads, small.ffn_dim) == (
        30, 1536, 12, 8960,
    )  # fmt: skip
    assert (big.num_layers, big.hidden_size, big.num_attention_heads, big.ffn_dim) == (
        40, 5120, 40, 13824,
    )  # fmt: skip
    for name, cfg in FLAVORS.items():
        cfg.validate()
        assert WanConfig.from_diffusers(cfg.to_diffusers()) == cfg, name
    assert small.rope_dims == (44, 42, 42)  # Wan's split of head_dim 128
    with pytest.raises(ConfigError, match=r"model\.flavor='huge'"):
        flavor("huge")


def test_read_config_from_a_pipeline_directory(tmp_path: Path) -> None:
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(RELEASED_1_3B))
    assert read_config(tmp_path) == flavor("t2v_1_3b")
    assert registry.family_of_diffusers_dir(tmp_path).name == "wan"
    with pytest.raises(ConfigError, match=r"model\.init_from"):
        read_config(tmp_path / "nothing")


def test_image_to_video_and_foreign_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="image_dim=1280 is image-to-video"):
        WanConfig.from_diffusers(RELEASED_1_3B | {"image_dim": 1280, "added_kv_proj_dim": 5120})
    with pytest.raises(ConfigError, match="is not a Wan transformer"):
        WanConfig.from_diffusers({"_class_name": "FluxTransformer2DModel"})


def test_validation_names_every_key() -> None:
    bad = flavor("tiny").replace(num_layers=0, ffn_dim=-3)
    with pytest.raises(ConfigError) as err:
        bad.validate()
    assert "model.num_layers=0" in str(err.value) and "model.ffn_dim=-3" in str(err.value)
    with pytest.raises(ConfigError, match="rotary split"):
        flavor("tiny").replace(attention_head_dim=4).validate()
    with pytest.raises(ConfigError, match="qk_norm"):
        flavor("tiny").replace(qk_norm="rms_norm").validate()
    with pytest.raises(
        ConfigError, match=r"tensor_parallel=5: must divide model.num_attention_heads=12"
    ):
        flavor("t2v_1_3b").validate_parallel(tensor_parallel=5)
    assert flavor("tiny").replace(recompute_blocks=-1).num_recomputed() == 2
    assert flavor("t2v_14b").replace(recompute_blocks=32).num_recomputed() == 32


def test_patchify_matches_the_conv3d_and_round_trips() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3, 6, 8)
    conv = torch.nn.Conv3d(4, 5, kernel_size=(1, 2, 2), stride=(1, 2, 2))
    tokens = patchify(x, (1, 2, 2))
    assert tokens.shape == (2, 3 * 3 * 4, 16)
    want = conv(x).flatten(2).transpose(1, 2)
    got = tokens @ conv.weight.reshape(5, -1).T + conv.bias
    assert (got - want).abs().max() < 1e-5
    assert torch.equal(unpatchify(tokens, (3, 3, 4), (1, 2, 2)), x)
    with pytest.raises(ValueError, match="not divisible by the patch"):
        patchify(x[..., :7], (1, 2, 2))


def test_pack_and_unpack_round_trip() -> None:
    samples = [torch.randn(4, 3, 8, 8), torch.randn(4, 5, 6, 10), torch.randn(4, 1, 4, 4)]
    tokens, packing = pack_latents(samples, (1, 2, 2))
    assert packing.grids == ((3, 4, 4), (5, 3, 5), (1, 2, 2))
    assert packing.cu_seqlens.tolist() == [0, 48, 123, 127] and packing.max_seqlen == 75
    assert tokens.shape == (127, 16)
    back = unpack_tokens(tokens, packing, (1, 2, 2))
    assert all(torch.equal(a, b) for a, b in zip(back, samples))
    with pytest.raises(ValueError, match="grids must be"):
        VideoPacking.from_grids([])


@pytest.mark.parametrize("grid", [(3, 4, 4), (5, 3, 5), (1, 2, 2)])
def test_rope_tables_match_diffusers(grid: tuple[int, int, int]) -> None:
    cfg = flavor("t2v_1_3b")
    ref = WanRotaryPosEmbed(cfg.attention_head_dim, cfg.patch_size, cfg.rope_max_seq_len)
    t, h, w = grid
    cos_ref, sin_ref = ref(torch.zeros(1, 1, t, 2 * h, 2 * w))
    cos, sin = rope_tables([grid], cfg)
    # diffusers repeats each pair's angle on both of its channels; we keep one per pair.
    assert (cos - cos_ref[0, :, 0, 0::2]).abs().max() < 1e-6
    assert (sin - sin_ref[0, :, 0, 0::2]).abs().max() < 1e-6
    two, _ = rope_tables([grid, (1, 2, 2)], cfg)  # packed: each sample starts at position 0
    assert torch.equal(two[: t * h * w], cos)
    assert torch.equal(two[t * h * w :], rope_tables([(1, 2, 2)], cfg)[0])


def test_registry() -> None:
    family = registry.get_family("wan")
    module = family.load()
    for name in ("FLAVORS", "flavor", "read_config", "build", "load_diffusers", "save_diffusers"):
        assert hasattr(module, name), name
    assert module.flavor("tiny") == flavor("tiny")
    with pytest.raises(ConfigError, match=r"model\.name='sd3'"):
        registry.get_family("sd3")


def test_registry_refuses_an_unknown_class(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    with pytest.raises(ConfigError, match="UNet2DConditionModel"):
        registry.family_of_diffusers_dir(tmp_path)
