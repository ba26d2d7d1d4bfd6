"""FLUX config (diffusers config.json in and out, flavors, validation), the 3-axis rotary
tables against diffusers' ``FluxPosEmbed``, and the family registry. No megatron needed."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxTransformer2DModel

from longboat.core.config.errors import ConfigError
from longboat.diffusion.models import registry
from longboat.diffusion.models.flux.config import FLAVORS, FluxConfig, flavor, read_config

# transformer/config.json of black-forest-labs/FLUX.1-dev as published.
RELEASED_DEV = {
    "_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.30.0.dev0",
    "attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64,
    "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19,
    "num_single_layers": 38, "patch_size": 1, "pooled_projection_dim": 768,
}  # fmt: skip


def test_defaults_are_diffusers_defaults() -> None:
    params = inspect.signature(FluxTransformer2DModel.__init__).parameters
    ours = FLAVORS["flux_schnell"].to_diffusers()  # schnell's shape is diffusers' default one
    assert set(ours) == set(params) - {"self"}
    for key, value in ours.items():
        default = params[key].default
        assert (list(default) if isinstance(default, tuple) else default) == value, key


def test_flavors() -> None:
    dev, schnell = flavor("flux_dev"), flavor("flux_schnell")
    assert FluxConfig.from_diffusers(RELEASED_DEV) == dev
    assert FluxConfig.from_diffusers(RELEASED_DEV | {"guidance_embeds": False}) == schnell
    assert (dev.num_layers, dev.num_single_layers, dev.hidden_size, dev.ffn_dim) == (
        19, 38, 3072, 12288,
    )  # fmt: skip
    assert dev.guidance_embeds and not schnell.guidance_embeds
    assert (dev.latent_channels, dev.latent_patch, dev.text_dim) == (16, (1, 2, 2), 4096)
    for name, cfg in FLAVORS.items():
        cfg.validate()
        assert FluxConfig.from_diffusers(cfg.to_diffusers()) == cfg, name
    with pytest.raises(ConfigError, match=r"model\.flavor='flux_pro'"):
        flavor("flux_pro")


def test_read_config_from_a_pipeline_directory(tmp_path: Path) -> None:
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(RELEASED_DEV))
    assert read_config(tmp_path) == flavor("flux_dev")
    assert registry.family_of_diffusers_dir(tmp_path).name == "flux"
    with pytest.raises(ConfigError, match=r"model\.init_from"):
        read_config(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="is not a FLUX transformer"):
        FluxConfig.from_diffusers({"_class_name": "WanTransformer3DModel"})


def test_validation_names_every_key() -> None:
    bad = flavor("tiny").replace(num_attention_heads=0, in_channels=-3)
    with pytest.raises(ConfigError) as err:
        bad.validate()
    assert "model.num_attention_heads=0" in str(err.value)
    assert "model.in_channels=-3" in str(err.value)
    with pytest.raises(ConfigError, match="must sum to attention_head_dim=16"):
        flavor("tiny").replace(axes_dims_rope=(4, 4, 4)).validate()
    with pytest.raises(ConfigError, match="2x2 latent patch"):
        flavor("tiny").replace(in_channels=30).validate()
    with pytest.raises(ConfigError, match="only 1 is implemented"):
        flavor("tiny").replace(patch_size=2).validate()
    with pytest.raises(ConfigError, match=r"tensor_parallel=5: must divide"):
        flavor("flux_dev").validate_parallel(tensor_parallel=5)
    with pytest.raises(ConfigError, match=r"parallel.context_parallel=2"):
        flavor("flux_dev").validate_parallel(tensor_parallel=1, context_parallel=2)
    assert flavor("tiny").replace(recompute_blocks=-1).num_recomputed() == 4
    assert flavor("flux_dev").replace(recompute_blocks=40).num_recomputed() == 40


@pytest.mark.parametrize(("grid", "text_len"), [((1, 3, 4), 5), ((2, 2, 3), 1)])
def test_rope_tables_match_diffusers(grid: tuple[int, int, int], text_len: int) -> None:
    from longboat.diffusion.models.flux.model import rope_tables

    cfg = flavor("flux_dev")
    t, h, w = grid
    ids = torch.zeros(t, h, w, 3)
    ids[..., 0] = torch.arange(t)[:, None, None]
    ids[..., 1] = torch.arange(h)[None, :, None]
    ids[..., 2] = torch.arange(w)[None, None, :]
    ids = torch.cat([torch.zeros(text_len, 3), ids.reshape(-1, 3)])
    cos_ref, sin_ref = FluxPosEmbed(theta=10000, axes_dim=list(cfg.axes_dims_rope))(ids)
    cos, sin = rope_tables(grid, text_len, cfg)
    # diffusers repeats each pair's angle on both of its channels; we keep one per pair.
    assert (cos - cos_ref[:, 0::2]).abs().max() < 1e-6
    assert (sin - sin_ref[:, 0::2]).abs().max() < 1e-6
    assert torch.equal(cos[:text_len], torch.ones(text_len, 64))  # caption ids are zero


def test_registry() -> None:
    family = registry.get_family("flux")
    module = family.load()
    for name in ("FLAVORS", "flavor", "read_config", "build", "load_diffusers", "save_diffusers"):
        assert hasattr(module, name), name
    assert module.flavor("tiny") == flavor("tiny")
    assert family.diffusers_classes == ("FluxTransformer2DModel",)
