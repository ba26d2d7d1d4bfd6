"""Qwen2.5-VL vision tower == transformers' (CPU, fp32, tiny config, random weights).

Our tower runs on megatron layers in gloo worker processes (world size 1, and 2 for TP=2);
transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` runs in the test process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Qwen2_5_VLConfig
from transformers import vision_utils as hf_vision
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)

from longboat.core.distributed import run_multiprocess
from longboat.vlm.models.qwen2_5_vl.vision import (
    VisionPacking,
    frame_cu_seqlens,
    vision_position_ids,
    window_partition,
)
from longboat.vlm.models.qwen2_5_vl.vision_config import (
    Qwen25VisionConfig,
    vision_flavor,
)
from longboat.vlm.models.qwen2_5_vl.vision_hf import (
    VisionStateDictError,
    shard_vision_state_dict,
    vision_from_hf,
    vision_to_hf,
)

HF_TOL = 1e-4  # max abs difference of the merged tokens vs transformers (fp32)
TP_TOL = 1e-5  # max abs difference TP=2 vs TP=1

CFG = vision_flavor("tiny")  # patch 4, merge 2, window 16 px = 2x2 merged tokens; full at 1, 3
CASES: dict[str, list[list[int]]] = {
    # 12x16 patches: 3x4 windows (the merged grid divides the window evenly).
    "one_image": [[1, 12, 16]],
    # Ragged windows at the right / bottom edges, a one-window image, a portrait image.
    "multi_resolution": [[1, 10, 14], [1, 4, 4], [1, 16, 6]],
    # A video of 4 temporal patches (8 frames), then an image in the same call.
    "video": [[4, 8, 12], [1, 6, 10]],
}


def _hf_tower(cfg: Qwen25VisionConfig, seed: int = 0) -> Qwen2_5_VisionTransformerPretrainedModel:
    vision = Qwen2_5_VLConfig(vision_config=cfg.to_hf()).vision_config
    vision._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen2_5_VisionTransformerPretrainedModel(vision).eval()
    with torch.no_grad():  # random norms too, so a swapped or skipped norm shows
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
            if "norm" in name or "ln_q" in name:
                p.add_(1.0)
    return model


def _inputs(grid: list[list[int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.tensor(grid)
    n = int((g[:, 0] * g[:, 1] * g[:, 2]).sum())
    x = torch.randn(n, CFG.patch_dim, generator=torch.Generator().manual_seed(seed))
    return x, g


def _tower_worker(
    rank: int, world: int, hf_state: dict[str, torch.Tensor], tp: int, kernels: bool = False
) -> dict[str, torch.Tensor]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.vlm.models.qwen2_5_vl.vision import Qwen25VisionModel

    parallel_state.initialize(ParallelConfig(tensor_parallel=tp), get_accelerator("cpu"), seed=3)
    try:
        layer_kernels = None
        if kernels:  # longboat-kernels' RMSNorm and SwiGLU instead of the torch defaults
            from longboat.core.megatron.specs import LayerKernels
            from longboat.kernels.rmsnorm import rms_norm
            from longboat.kernels.swiglu import swiglu

            layer_kernels = LayerKernels(rms_norm=rms_norm, swiglu=swiglu, name="longboat")
        model = Qwen25VisionModel(CFG, kernels=layer_kernels).eval()
        full = vision_from_hf(hf_state, CFG)
        missing, unexpected = model.load_state_dict(
            shard_vision_state_dict(full, rank, tp), strict=False
        )
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
        out = {}
        with torch.no_grad():
            for i, (name, grid) in enumerate(CASES.items()):
                x, g = _inputs(grid, seed=i)
                out[name] = model(x, g)
        return out
    finally:
        parallel_state.destroy()


@pytest.fixture(scope="module")
def hf_tower() -> Qwen2_5_VisionTransformerPretrainedModel:
    return _hf_tower(CFG)


@pytest.fixture(scope="module")
def hf_outputs(hf_tower: Any) -> dict[str, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for i, (name, grid) in enumerate(CASES.items()):
            x, g = _inputs(grid, seed=i)
            out[name] = hf_tower(x, grid_thw=g).pooler_output
    return out


@pytest.fixture(scope="module")
def ours_tp1(hf_tower: Any) -> dict[str, torch.Tensor]:
    return run_multiprocess(_tower_worker, 1, hf_tower.state_dict(), 1)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_tower_matches_transformers(
    case: str, ours_tp1: dict[str, torch.Tensor], hf_outputs: dict[str, torch.Tensor]
) -> None:
    grid = torch.tensor(CASES[case])
    packing = VisionPacking.build(grid, CFG)
    frames = int(grid[:, 0].sum())
    # Window attention really partitions: more windows than frames.
    assert packing.window.cu_seqlens_q.numel() - 1 > frames
    assert packing.full.cu_seqlens_q.numel() - 1 == frames
    got, want = ours_tp1[case], hf_outputs[case]
    assert (
        got.shape == want.shape == (int(grid.prod(1).sum()) // CFG.merge_unit, CFG.out_hidden_size)
    )
    diff = (got - want).abs().max().item()
    assert diff < HF_TOL, f"{case}: max abs diff {diff:.3g} vs transformers"
    assert want.abs().max().item() > 1.0  # a meaningful scale, not all zeros


def test_tower_with_longboat_kernels_matches_transformers(
    hf_tower: Any, hf_outputs: dict[str, torch.Tensor]
) -> None:
    out = run_multiprocess(_tower_worker, 1, hf_tower.state_dict(), 1, True)[0]
    for case in CASES:
        diff = (out[case] - hf_outputs[case]).abs().max().item()
        assert diff < HF_TOL, f"{case}: max abs diff {diff:.3g} vs transformers"


@pytest.mark.multiprocess
def test_tp2_equals_tp1(hf_tower: Any, ours_tp1: dict[str, torch.Tensor]) -> None:
    outs = run_multiprocess(_tower_worker, 2, hf_tower.state_dict(), 2)
    for rank, out in enumerate(outs):
        for case in CASES:
            diff = (out[case] - ours_tp1[case]).abs().max().item()
            assert diff < TP_TOL, f"rank {rank} {case}: TP=2 vs TP=1 max abs diff {diff:.3g}"


@pytest.mark.parametrize(
    "grid",
    [[[1, 12, 16]], [[1, 10, 14], [1, 4, 4], [1, 16, 6]], [[4, 8, 12], [1, 6, 10]], [[2, 30, 2]]],
)
def test_geometry_matches_transformers(grid: list[list[int]]) -> None:
    g = torch.tensor(grid)
    index, cu = window_partition(g, CFG)
    want_index, want_cu = hf_vision.get_vision_window_index(
        g, CFG.spatial_merge_size, CFG.window_size, CFG.patch_size
    )
    assert torch.equal(index, want_index)
    assert torch.equal(cu, want_cu)
    assert torch.equal(
        vision_position_ids(g, CFG.spatial_merge_size), hf_vision.get_vision_position_ids(g, 2)
    )
    assert torch.equal(frame_cu_seqlens(g), hf_vision.get_vision_cu_seqlens(g))


def test_state_dict_round_trip_is_exact(hf_tower: Any) -> None:
    hf = hf_tower.state_dict()
    for prefix in ("", "visual.", "model.visual."):
        prefixed = {prefix + k: v for k, v in hf.items()}
        back = vision_to_hf(vision_from_hf(prefixed, CFG), CFG, prefix=prefix)
        assert back.keys() == prefixed.keys()
        for k, v in prefixed.items():
            assert torch.equal(back[k], v), k


def test_reads_the_tower_of_a_full_model() -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    text = dict(
        vocab_size=128, hidden_size=CFG.out_hidden_size, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]},
    )  # fmt: skip
    config = Qwen2_5_VLConfig(vision_config=CFG.to_hf(), text_config=text)
    model = Qwen2_5_VLForConditionalGeneration(config)
    full = model.state_dict()
    ours = vision_from_hf(full, CFG)  # text keys are ignored
    back = vision_to_hf(ours, CFG)
    visual = {k: v for k, v in full.items() if k.startswith("model.visual.")}
    assert back.keys() == visual.keys()
    assert all(torch.equal(back[k], visual[k]) for k in visual)
    assert Qwen25VisionConfig.from_hf(config.vision_config.to_dict()) == CFG


def test_state_dict_errors_name_the_keys(hf_tower: Any) -> None:
    hf = {"model.visual." + k: v for k, v in hf_tower.state_dict().items()}
    broken = dict(hf)
    del broken["model.visual.blocks.2.attn.qkv.bias"]
    broken["model.visual.blocks.9.norm1.weight"] = torch.ones(CFG.hidden_size)
    broken["model.visual.merger.mlp.2.weight"] = torch.ones(3, 3)
    with pytest.raises(VisionStateDictError) as err:
        vision_from_hf(broken, CFG)
    msg = str(err.value)
    assert "model.visual.blocks.2.attn.qkv.bias" in msg
    assert "model.visual.blocks.9.norm1.weight" in msg
    assert "model.visual.merger.mlp.2.weight: (3, 3)" in msg


def test_config_from_released_and_validation() -> None:
    released_7b = {  # the vision_config of Qwen/Qwen2.5-VL-7B-Instruct's config.json
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
        "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
        "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2,
    }  # fmt: skip
    assert Qwen25VisionConfig.from_hf(released_7b) == vision_flavor("7b")
    for name in ("3b", "7b", "32b", "72b", "tiny"):
        cfg = vision_flavor(name)
        assert Qwen25VisionConfig.from_hf(cfg.to_hf()) == cfg
    assert {vision_flavor(n).out_hidden_size for n in ("3b", "7b", "72b")} == {2048, 3584, 8192}
    with pytest.raises(ValueError, match=r"window_size=20 is not a multiple of .* 8"):
        CFG.replace(window_size=20).validate()
    with pytest.raises(ValueError, match=r"fullatt_block_indexes has \[4\]"):
        CFG.replace(fullatt_block_indexes=(1, 4)).validate()
    with pytest.raises(ValueError, match="unknown"):
        vision_flavor("huge")
