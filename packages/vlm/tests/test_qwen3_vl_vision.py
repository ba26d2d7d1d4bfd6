"""Qwen3-VL's vision side without megatron: the image processor against transformers'
(bit-exact), the tower's config and HF state dicts (exact round trips, errors naming keys).

The tower's outputs (merged tokens and deepstack features) are compared with
``Qwen3VLVisionModel`` in ``test_qwen3_vl_model.py``, at TP=1 and TP=2.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3VLConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from longboat.core.config.errors import ConfigError
from longboat.vlm.data.processor import VisionProcessorConfig
from longboat.vlm.models.qwen3_vl.processor import qwen3_vl_processor
from longboat.vlm.models.qwen3_vl.vision_config import Qwen3VisionConfig, vision_flavor
from longboat.vlm.models.qwen3_vl.vision_hf import (
    VisionStateDictError,
    shard_vision_state_dict,
    unshard_vision_state_dict,
    vision_from_hf,
    vision_to_hf,
)

QWEN3_VL_PREPROCESSOR = {  # the preprocessor_config.json of the released Qwen3-VL checkpoints
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}  # fmt: skip
QWEN3_VL_VIDEO_PREPROCESSOR = {  # their video_preprocessor_config.json
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "fps": 2, "min_frames": 4, "max_frames": 768,
}  # fmt: skip
CFG = vision_flavor("tiny")


def _image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)), (xx + yy) % 256], -1)
    return Image.fromarray(
        np.clip(base + rng.integers(-40, 41, (h, w, 3)), 0, 255).astype(np.uint8)
    )


@pytest.mark.parametrize(
    ("h", "w", "max_pixels"),
    [(40, 50, None), (300, 420, None), (1500, 900, 1003520)],  # up to 64K px, as is, capped
)
def test_image_processor_matches_transformers(h: int, w: int, max_pixels: int | None) -> None:
    hf_cfg = dict(QWEN3_VL_PREPROCESSOR)
    if max_pixels is not None:
        hf_cfg["size"] = {**hf_cfg["size"], "longest_edge": max_pixels}
    ours = qwen3_vl_processor(vision_flavor("8b"), hf_cfg["size"]["shortest_edge"],
                              hf_cfg["size"]["longest_edge"])  # fmt: skip
    released = VisionProcessorConfig.from_hf(hf_cfg, QWEN3_VL_VIDEO_PREPROCESSOR)
    assert ours.config == dataclasses.replace(released, max_video_tokens=768)
    img = _image(h, w, seed=h)
    want = Qwen2VLImageProcessorPil(**hf_cfg)(images=[img], return_tensors="pt")
    got = ours.preprocess_images([img])
    assert got["image_grid_thw"].tolist() == want["image_grid_thw"].tolist()
    assert got["pixel_values"].shape == want["pixel_values"].shape
    assert (got["pixel_values"] - want["pixel_values"]).abs().max().item() == 0.0
    t, gh, gw = want["image_grid_thw"][0].tolist()
    assert t == 1 and gh % 2 == 0 and gw % 2 == 0
    assert 65536 <= gh * gw * 256 <= (max_pixels or 16777216)


@pytest.fixture(scope="module")
def hf_tower() -> Qwen3VLVisionModel:
    vision = Qwen3VLConfig(vision_config=CFG.to_hf()).vision_config
    torch.manual_seed(0)
    return Qwen3VLVisionModel(vision).eval()


def test_state_dict_round_trip_is_exact(hf_tower: Qwen3VLVisionModel) -> None:
    hf = hf_tower.state_dict()
    for prefix in ("", "visual.", "model.visual."):
        prefixed = {prefix + k: v for k, v in hf.items()}
        ours = vision_from_hf(prefixed, CFG)
        back = vision_to_hf(ours, CFG, prefix=prefix)
        assert back.keys() == prefixed.keys()
        assert all(torch.equal(back[k], v) for k, v in prefixed.items())
    shards = [shard_vision_state_dict(ours, r, 2) for r in range(2)]
    assert shards[0]["layers.0.mlp.linear_fc1.weight"].shape == (CFG.intermediate_size // 2, 32)
    assert shards[1]["merger.deepstack.1.linear_fc2.weight"].shape == (64, 64)
    full = unshard_vision_state_dict(shards)
    assert full.keys() == ours.keys() and all(torch.equal(full[k], ours[k]) for k in ours)


def test_state_dict_errors_name_the_keys(hf_tower: Qwen3VLVisionModel) -> None:
    hf = {"model.visual." + k: v for k, v in hf_tower.state_dict().items()}
    del hf["model.visual.deepstack_merger_list.1.norm.bias"]
    hf["model.visual.blocks.7.norm1.weight"] = torch.ones(CFG.hidden_size)
    hf["model.visual.pos_embed.weight"] = torch.ones(9, CFG.hidden_size)
    with pytest.raises(VisionStateDictError) as err:
        vision_from_hf(hf, CFG)
    msg = str(err.value)
    assert "missing ['model.visual.deepstack_merger_list.1.norm.bias']" in msg
    assert "unexpected ['model.visual.blocks.7.norm1.weight']" in msg
    assert "model.visual.pos_embed.weight: (9, 32) != expected (16, 32)" in msg


def test_config_from_released_and_validation() -> None:
    released_8b = {  # the vision_config of Qwen/Qwen3-VL-8B-Instruct's config.json
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02,
        "intermediate_size": 4304, "model_type": "qwen3_vl", "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    }  # fmt: skip
    assert Qwen3VisionConfig.from_hf(released_8b) == vision_flavor("8b")
    for name in ("2b", "4b", "8b", "tiny"):
        assert Qwen3VisionConfig.from_hf(vision_flavor(name).to_hf()) == vision_flavor(name)
    with pytest.raises(ConfigError, match=r"num_position_embeddings=15: must be a square"):
        CFG.replace(num_position_embeddings=15).validate()
    with pytest.raises(ConfigError, match=r"deepstack_visual_indexes has \[3\] outside 0..2"):
        CFG.replace(deepstack_visual_indexes=(0, 3)).validate()
    with pytest.raises(ConfigError, match=r"hidden_act='relu'"):
        CFG.replace(hidden_act="relu").validate()
    with pytest.raises(ConfigError, match="unknown"):
        vision_flavor("huge")
