"""Qwen2.5-VL logits == transformers' (CPU, fp32, tiny config, random weights, no downloads).

A tiny ``Qwen2_5_VLForConditionalGeneration`` is built from our ``tiny`` flavor's HF config
and saved; longboat reads the directory (architecture from config.json), loads it into
megatron gloo workers (TP=1 and TP=2) and compares logits for text only, one image, several
images of different resolutions, a video, and a packed row of two samples against each
sample alone. The export (TP shards gathered) is loaded back with ``transformers`` and gives
the same logits.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from longboat.core.distributed import run_multiprocess
from longboat.vlm.models.mrope import mrope_position_ids, token_types
from longboat.vlm.models.qwen2_5_vl.model import flavor, read_hf_config, to_hf_config

TOL = 1e-4  # max abs logit difference vs transformers (fp32)
CFG = flavor("tiny")
V = CFG.vision
IMG, VID, VS, VE = (
    CFG.image_token_id,
    CFG.video_token_id,
    CFG.vision_start_token_id,
    CFG.vision_end_token_id,
)


def _vision_run(token: int, grid: list[int]) -> list[int]:
    n = grid[0] * grid[1] * grid[2] // (V.spatial_merge_size**2)
    return [VS, *([token] * n), VE]


def _case(name: str, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(0, 300, (n,), generator=g).tolist()

    images: list[list[int]] = []
    videos: list[list[int]] = []
    if name == "text":
        ids = text(23)
    elif name == "one_image":
        images = [[1, 8, 12]]
        ids = text(5) + _vision_run(IMG, images[0]) + text(7)
    elif name == "multi_image":
        images = [[1, 10, 6], [1, 4, 4], [1, 6, 14]]
        ids = text(3)
        for grid in images:
            ids += _vision_run(IMG, grid) + text(4)
    elif name == "video":
        videos = [[3, 8, 8]]
        images = [[1, 4, 6]]
        ids = text(4) + _vision_run(VID, videos[0]) + text(3) + _vision_run(IMG, images[0])
        ids += text(2)
    else:
        raise KeyError(name)
    out: dict[str, Any] = {"input_ids": torch.tensor([ids])}
    for key, grids in (("image", images), ("video", videos)):
        if grids:
            gt = torch.tensor(grids)
            n = int(gt.prod(-1).sum())
            pv = torch.randn(n, V.patch_dim, generator=g)
            out["pixel_values" if key == "image" else "pixel_values_videos"] = pv
            out[f"{key}_grid_thw"] = gt
    return out


CASES = ("text", "one_image", "multi_image", "video")


def _hf_logits(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    types = token_types(batch["input_ids"], IMG, VID).int()
    with torch.no_grad():
        return model(**batch, mm_token_type_ids=types).logits


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf_cfg = to_hf_config(CFG)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a dropped one shows
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.08)
            if "norm" in name or "ln_q" in name:
                p.add_(1.0)
    out = tmp_path_factory.mktemp("qwen2_5_vl_tiny")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(hf_dir: Path) -> dict[str, torch.Tensor]:
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, attn_implementation="sdpa")
    model.eval()
    return {name: _hf_logits(model, _case(name, i)) for i, name in enumerate(CASES)}


def _worker(rank: int, world: int, hf_dir: Path, tp: int, export: Path | None) -> dict[str, Any]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.hf_io import rank_coords, tp_shards
    from longboat.vlm.models.qwen2_5_vl.model import build_qwen2_5_vl, load_hf, save_hf

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(tensor_parallel=tp), get_accelerator("cpu"))
    try:
        model = build_qwen2_5_vl(cfg)
        load_hf(model, cfg, hf_dir)
        model.eval()
        coords = rank_coords()
        out: dict[str, Any] = {}
        with torch.no_grad():
            for i, name in enumerate(CASES):
                logits = model(**_case(name, i))
                out[name] = torch.cat(tp_shards(logits, coords), dim=-1)
            # Packed: "one_image" and "multi_image" in one row == each alone.
            a, b = _case("one_image", 1), _case("multi_image", 2)
            la, lb = a["input_ids"].shape[1], b["input_ids"].shape[1]
            packed = {
                "input_ids": torch.cat([a["input_ids"], b["input_ids"]], dim=1),
                "pixel_values": torch.cat([a["pixel_values"], b["pixel_values"]]),
                "image_grid_thw": torch.cat([a["image_grid_thw"], b["image_grid_thw"]]),
            }
            logits = model(**packed, cu_seqlens=[0, la, la + lb])
            # The packed row reached longboat's attention as offsets (varlen), not a dense mask.
            assert model._varlen_decoder
            out["packed"] = torch.cat(tp_shards(logits, coords), dim=-1)
        if export is not None:
            save_hf(model, cfg, export)
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_transformers(
    tp: int, hf_dir: Path, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    export = tmp_path / "export"
    outs = run_multiprocess(_worker, tp, hf_dir, tp, export, timeout=300)
    for got in outs:
        for name in CASES:
            diff = (got[name] - reference[name]).abs().max().item()
            assert diff < TOL, f"{name} (TP={tp}): max |dlogit| {diff:.2e} >= {TOL}"
        alone = torch.cat([reference["one_image"], reference["multi_image"]], dim=1)
        diff = (got["packed"] - alone).abs().max().item()
        assert diff < TOL, f"packed (TP={tp}): max |dlogit| {diff:.2e} vs each sample alone"
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        export, attn_implementation="sdpa"
    ).eval()
    for i, name in enumerate(CASES):
        diff = (_hf_logits(reloaded, _case(name, i)) - reference[name]).abs().max().item()
        assert diff < TOL, f"export, {name}: max |dlogit| {diff:.2e} after the round trip"


def test_config_round_trip(hf_dir: Path) -> None:
    """config.json -> ours -> HF config -> ours is the identity."""
    cfg = read_hf_config(hf_dir)
    assert cfg.architecture() == CFG.architecture()
    assert read_hf_config(to_hf_config(cfg).to_dict()) == cfg


def test_tiny_grid_positions_turn_the_rotary() -> None:
    """The tiny decoder's M-RoPE height and width streams (the 6 lowest of its 8 frequencies,
    contiguous sections as transformers lays them) turn by at least 0.1 rad per merged patch,
    so the quickstart's 7 x 7 grid has readable positions (qwen2's theta 1e6: under 2e-4)."""
    lang = CFG.language
    half = lang.head_dim // 2
    inv_freq = lang.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
    t, h, w = lang.mrope_section
    assert t + h + w == half
    assert inv_freq[t : t + h].min() > 0.3 and inv_freq[t + h :].min() > 0.1


def test_position_ids_match_transformers(hf_dir: Path) -> None:
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir).model
    for i, name in enumerate(CASES):
        batch = _case(name, i)
        ids = batch["input_ids"]
        if name == "text":
            want = torch.arange(ids.shape[1]).expand(3, 1, -1)
        else:
            want, _ = model.get_rope_index(
                ids,
                token_types(ids, IMG, VID).int(),
                image_grid_thw=batch.get("image_grid_thw"),
                video_grid_thw=batch.get("video_grid_thw"),
            )
        got = mrope_position_ids(
            ids,
            image_token_id=IMG,
            video_token_id=VID,
            spatial_merge_size=V.spatial_merge_size,
            tokens_per_second=CFG.tokens_per_second,
            image_grid_thw=batch.get("image_grid_thw"),
            video_grid_thw=batch.get("video_grid_thw"),
        )
        assert torch.equal(got, want), name


def test_joints_are_validated() -> None:
    from longboat.core.config.errors import ConfigError

    bad = dataclasses.replace(CFG, vision=V.replace(out_hidden_size=32))
    with pytest.raises(ConfigError, match=r"model.vision.out_hidden_size=32 must equal"):
        bad.validate()
    bad = dataclasses.replace(
        CFG, language=dataclasses.replace(CFG.language, mrope_section=[2, 2, 2])
    )
    with pytest.raises(ConfigError, match=r"model.language.mrope_section=\[2, 2, 2\]"):
        bad.validate()
    bad = dataclasses.replace(CFG, image_token_id=400)
    with pytest.raises(ConfigError, match=r"model.image_token_id=400: outside the vocabulary"):
        bad.validate()


def _load_error_worker(rank: int, world: int, hf_dir: Path) -> str:
    from longboat.core.config.errors import ConfigError
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.vlm.models.qwen2_5_vl.model import build_qwen2_5_vl, load_hf

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"))
    try:
        load_hf(build_qwen2_5_vl(cfg), cfg, hf_dir)
        return ""
    except ConfigError as exc:
        return str(exc)
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_a_tower_that_does_not_fit_is_a_config_error_naming_the_tensor(
    hf_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    (weights,) = broken.glob("*.safetensors")
    state = load_file(str(weights))
    dropped = next(k for k in sorted(state) if "visual.merger" in k)
    del state[dropped]
    save_file(state, str(weights), metadata={"format": "pt"})
    (message,) = run_multiprocess(_load_error_worker, 1, broken)
    assert str(broken) in message and "merger" in message, message
