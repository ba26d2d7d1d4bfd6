"""Qwen3-VL logits == transformers' (CPU, fp32, tiny config, random weights, no downloads).

A tiny ``Qwen3VLForConditionalGeneration`` is built from our ``tiny`` flavor's HF config
(a 3-block ViT with deepstack mergers after blocks 0 and 1, a 4-layer qwen3 decoder with
interleaved M-RoPE) and saved; longboat reads the directory, loads it into megatron gloo
workers (TP=1, TP=2, and PP=2 through the pipeline schedule) and compares logits for text only, one image, several images of
different resolutions, a video (each frame group behind its timestamp text, as Qwen3-VL's
processor writes it) with an image, and a packed row of two samples against each sample
alone; the tower's merged tokens and deepstack features against ``Qwen3VLVisionModel``'s;
megatron's rotary angles for the interleaved layout against transformers' text rotary. The
export (TP shards gathered; one shard per pipeline stage) is loaded back with
``transformers`` and gives the same logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from longboat.core.distributed import run_multiprocess
from longboat.vlm.models.mrope import (
    interleaved_mrope_sections,
    interleaved_mrope_streams,
    mrope_position_ids,
    token_types,
)
from longboat.vlm.models.qwen3_vl.model import flavor, read_hf_config, to_hf_config

TOL = 1e-4  # max abs logit difference vs transformers (fp32)
TP_TOL = 1e-5  # TP=2 vs TP=1
CFG = flavor("tiny")
V = CFG.vision
IMG, VID, VS, VE = (
    CFG.image_token_id,
    CFG.video_token_id,
    CFG.vision_start_token_id,
    CFG.vision_end_token_id,
)


def _tokens(token: int, grid: list[int]) -> list[int]:
    return [token] * (grid[1] * grid[2] // V.merge_unit)


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
        ids = [*text(5), VS, *_tokens(IMG, images[0]), VE, *text(7)]
    elif name == "multi_image":
        images = [[1, 10, 6], [1, 4, 4], [1, 6, 14]]  # smaller and larger than the 4x4 table
        ids = text(3)
        for grid in images:
            ids += [VS, *_tokens(IMG, grid), VE, *text(4)]
    elif name == "video":
        videos = [[3, 8, 8]]
        images = [[1, 4, 6]]
        ids = text(4)
        for _ in range(videos[0][0]):  # "<t seconds>" text, then the frame group's tokens
            ids += [*text(3), VS, *_tokens(VID, videos[0]), VE]
        ids += [*text(3), VS, *_tokens(IMG, images[0]), VE, *text(2)]
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
TOWER_GRIDS = [[1, 8, 12], [2, 6, 4], [1, 2, 2]]  # a video of two frame groups among images


def _hf_logits(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    types = token_types(batch["input_ids"], IMG, VID).int()
    with torch.no_grad():
        return model(**batch, mm_token_type_ids=types).logits


def _tower_input(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(TOWER_GRIDS)
    x = torch.randn(
        int(grid.prod(-1).sum()), V.patch_dim, generator=torch.Generator().manual_seed(seed)
    )
    return x, grid


def _positions(seq: int) -> torch.Tensor:
    """``[3, 1, seq]`` position ids whose three streams differ (so a swapped stream shows)."""
    base = torch.arange(seq)
    return torch.stack([base, base * 2 + 1, base * 3 + 2])[:, None]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf_cfg = to_hf_config(CFG)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a dropped one shows
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.08)
            if "norm" in name:
                p.add_(1.0)
            if "pos_embed" in name:
                p.mul_(10.0)  # learned positions that matter next to the patch embedding
    out = tmp_path_factory.mktemp("qwen3_vl_tiny")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(hf_dir: Path) -> dict[str, Any]:
    model = Qwen3VLForConditionalGeneration.from_pretrained(hf_dir, attn_implementation="sdpa")
    model.eval()
    out: dict[str, Any] = {name: _hf_logits(model, _case(name, i)) for i, name in enumerate(CASES)}
    out["video_4"] = _hf_logits(model, _case("video", 4))
    x, grid = _tower_input()
    with torch.no_grad():
        tower = model.model.visual(x, grid_thw=grid)
        text = model.model.language_model
        pos = _positions(11)
        cos, sin = text.rotary_emb(torch.zeros(1, 11, 1), pos)
    out["tower"] = (tower.pooler_output, list(tower.deepstack_features))
    out["rotary"] = (cos[0], sin[0])  # [seq, head_dim]
    return out


def _worker(rank: int, world: int, hf_dir: Path, tp: int, export: Path | None) -> dict[str, Any]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.hf_io import rank_coords, tp_shards
    from longboat.vlm.models.qwen3_vl.model import build, load_hf, save_hf

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(tensor_parallel=tp), get_accelerator("cpu"))
    try:
        model = build(cfg)
        load_hf(model, cfg, hf_dir)
        model.eval()
        coords = rank_coords()
        out: dict[str, Any] = {}
        with torch.no_grad():
            for i, name in enumerate(CASES):
                logits = model(**_case(name, i))
                out[name] = torch.cat(tp_shards(logits, coords), dim=-1)
            # Packed: "one_image" and "video" in one row == each alone.
            a, b = _case("one_image", 1), _case("video", 3)
            la, lb = a["input_ids"].shape[1], b["input_ids"].shape[1]
            packed = {
                "input_ids": torch.cat([a["input_ids"], b["input_ids"]], dim=1),
                "pixel_values": torch.cat([a["pixel_values"], b["pixel_values"]]),
                "image_grid_thw": torch.cat([a["image_grid_thw"], b["image_grid_thw"]]),
                "pixel_values_videos": b["pixel_values_videos"],
                "video_grid_thw": b["video_grid_thw"],
            }
            logits = model(**packed, cu_seqlens=[0, la, la + lb])
            out["packed"] = torch.cat(tp_shards(logits, coords), dim=-1)
            merged, deepstack = model.vision(*_tower_input())
            out["tower"] = (merged, deepstack)
            rope = model.language.rotary_pos_emb(_positions(11), model.language.mrope_section)
            out["rotary"] = rope[:, 0, 0]  # [seq, head_dim] angles
        if export is not None:
            save_hf(model, cfg, export)
        return out
    finally:
        parallel_state.destroy()


@pytest.fixture(scope="module")
def ours_tp1(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    export = tmp_path_factory.mktemp("qwen3_vl_export_tp1")
    out = run_multiprocess(_worker, 1, hf_dir, 1, export, timeout=300)[0]
    out["export"] = export
    return out


def _check_logits(got: dict[str, Any], reference: dict[str, Any], what: str) -> None:
    for name in CASES:
        diff = (got[name] - reference[name]).abs().max().item()
        assert diff < TOL, f"{name} ({what}): max |dlogit| {diff:.2e} >= {TOL}"
    alone = torch.cat([reference["one_image"], reference["video"]], dim=1)
    diff = (got["packed"] - alone).abs().max().item()
    assert diff < TOL, f"packed ({what}): max |dlogit| {diff:.2e} vs each sample alone"


def test_logits_match_transformers(ours_tp1: dict[str, Any], reference: dict[str, Any]) -> None:
    _check_logits(ours_tp1, reference, "TP=1")
    # The deepstack features change the logits (a dropped injection would show above).
    assert reference["one_image"].abs().max() > 0.1


def test_vision_tower_matches_transformers(
    ours_tp1: dict[str, Any], reference: dict[str, Any]
) -> None:
    (merged, deepstack), (want, want_deep) = ours_tp1["tower"], reference["tower"]
    assert merged.shape == want.shape == (int(torch.tensor(TOWER_GRIDS).prod(-1).sum()) // 4, 64)
    assert (merged - want).abs().max().item() < TOL
    assert len(deepstack) == len(want_deep) == 2
    for k, (a, b) in enumerate(zip(deepstack, want_deep, strict=True)):
        assert (a - b).abs().max().item() < TOL, f"deepstack feature {k}"
    assert want.abs().max().item() > 0.5  # a meaningful scale, not all zeros


def test_interleaved_rotary_matches_transformers(
    ours_tp1: dict[str, Any], reference: dict[str, Any]
) -> None:
    angles = ours_tp1["rotary"]
    cos, sin = reference["rotary"]
    assert (angles.cos() - cos).abs().max().item() < 1e-5
    assert (angles.sin() - sin).abs().max().item() < 1e-5


def test_export_reloads_in_transformers(
    ours_tp1: dict[str, Any], reference: dict[str, Any]
) -> None:
    reloaded = Qwen3VLForConditionalGeneration.from_pretrained(
        ours_tp1["export"], attn_implementation="sdpa"
    ).eval()
    for i, name in enumerate(CASES):
        diff = (_hf_logits(reloaded, _case(name, i)) - reference[name]).abs().max().item()
        assert diff < TOL, f"export, {name}: max |dlogit| {diff:.2e} after the round trip"


@pytest.mark.multiprocess
def test_tp2_matches_tp1_and_transformers(
    hf_dir: Path, reference: dict[str, Any], ours_tp1: dict[str, Any], tmp_path: Path
) -> None:
    export = tmp_path / "export"
    outs = run_multiprocess(_worker, 2, hf_dir, 2, export, timeout=300)
    for rank, got in enumerate(outs):
        _check_logits(got, reference, f"TP=2 rank {rank}")
        (merged, deepstack), (want, want_deep) = got["tower"], ours_tp1["tower"]
        assert (merged - want).abs().max().item() < TP_TOL
        for a, b in zip(deepstack, want_deep, strict=True):
            assert (a - b).abs().max().item() < TP_TOL
    reloaded = Qwen3VLForConditionalGeneration.from_pretrained(export).eval()
    diff = (_hf_logits(reloaded, _case("video", 3)) - reference["video"]).abs().max().item()
    assert diff < TOL, f"TP=2 export: max |dlogit| {diff:.2e}"


def _microbatch(batch: dict[str, Any]) -> dict[str, Any]:
    """A training row of ``batch``: every next token a target."""
    ids = batch["input_ids"]
    labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    mask = torch.ones(ids.shape, dtype=torch.float32)
    mask[:, -1] = 0
    return {**batch, "labels": labels, "loss_mask": mask}


def _pp_worker(rank: int, world: int, hf_dir: Path, export: Path) -> float:
    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.vlm.models.qwen3_vl.model import build, load_hf, save_hf
    from longboat.vlm.train.step import VLMTrainStep

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(pipeline_parallel=2), get_accelerator("cpu"))
    try:
        model = build(cfg)  # stage 0: the tower, the embedding and both deepstack layers
        assert (model.vision is not None) == (rank == 0)
        load_hf(model, cfg, hf_dir)
        step = VLMTrainStep(model, OptimConfig(), precision="fp32")
        loss = step.evaluate([_microbatch(_case("video", seed)) for seed in (3, 4)])
        save_hf(model, cfg, export)
        return loss
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_pp2_matches_transformers(hf_dir: Path, reference: dict[str, Any], tmp_path: Path) -> None:
    export = tmp_path / "export"
    losses = run_multiprocess(_pp_worker, 2, hf_dir, export, timeout=300)
    num = den = 0.0
    for seed, logits in ((3, reference["video"]), (4, reference["video_4"])):
        ids = _case("video", seed)["input_ids"]
        ce = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        num, den = num + float(ce), den + ids.shape[1] - 1
    want = num / den
    for got in losses:  # every stage reports the last stage's loss
        assert abs(got - want) < 1e-5 * want, f"PP=2 eval loss {got} vs transformers' {want}"
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2, "one shard per pipeline stage"
    reloaded = Qwen3VLForConditionalGeneration.from_pretrained(export).eval()
    diff = (_hf_logits(reloaded, _case("video", 3)) - reference["video"]).abs().max().item()
    assert diff < TOL, f"PP=2 export: max |dlogit| {diff:.2e}"


def test_position_ids_match_transformers(hf_dir: Path) -> None:
    model = Qwen3VLForConditionalGeneration.from_pretrained(hf_dir).model
    for i, name in enumerate(CASES[1:], start=1):
        batch = _case(name, i)
        ids = batch["input_ids"]
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
            tokens_per_second=1.0,
            image_grid_thw=batch.get("image_grid_thw"),
            video_grid_thw=batch.get("video_grid_thw"),
            frames_as_runs=True,
        )
        assert torch.equal(got, want), name


def test_interleaved_sections() -> None:
    # Qwen3-VL's released layout: 20 (t, h, w) triples, then 4 more temporal frequencies.
    streams = interleaved_mrope_streams([24, 20, 20], 128)
    assert streams[:6] == [0, 1, 2, 0, 1, 2] and streams[60:] == [0, 0, 0, 0]
    assert [streams.count(s) for s in range(3)] == [24, 20, 20]
    chunks = interleaved_mrope_sections([24, 20, 20], 128)
    assert chunks == [1, 1, 1] * 20 + [4, 0, 0]
    # Unequal height / width parts need empty chunks to skip a stream.
    streams = interleaved_mrope_streams([6, 3, 1], 20)
    assert streams == [0, 1, 2, 0, 1, 0, 0, 1, 0, 0]
    chunks = interleaved_mrope_sections([6, 3, 1], 20)
    expanded = [i % 3 for i, n in enumerate(chunks) for _ in range(n)]
    assert expanded == streams and len(chunks) % 3 == 0


def test_config_round_trip(hf_dir: Path) -> None:
    """config.json -> ours -> HF config -> ours is the identity."""
    cfg = read_hf_config(hf_dir)
    assert cfg.architecture() == CFG.architecture()
    assert read_hf_config(to_hf_config(cfg).to_dict()) == cfg
    for name in ("2b", "4b", "8b"):
        big = flavor(name)
        assert read_hf_config(to_hf_config(big).to_dict()).architecture() == big.architecture()


def test_joints_are_validated() -> None:
    from longboat.core.config.errors import ConfigError

    bad = dataclasses.replace(CFG, vision=V.replace(out_hidden_size=32))
    with pytest.raises(ConfigError, match=r"model.vision.out_hidden_size=32 must equal"):
        bad.validate()
    bad = dataclasses.replace(
        CFG, language=dataclasses.replace(CFG.language, mrope_section=[2, 3, 3])
    )
    with pytest.raises(ConfigError, match=r"mrope_section=\[2, 3, 3\]: the interleaved layout"):
        bad.validate()
    bad = dataclasses.replace(CFG, vision=V.replace(deepstack_visual_indexes=(0, 1, 2, 2)))
    with pytest.raises(ConfigError, match=r"deepstack_visual_indexes: an index is listed twice"):
        bad.validate()
    bad = dataclasses.replace(CFG, image_token_id=400)
    with pytest.raises(ConfigError, match=r"model.image_token_id=400: outside the vocabulary"):
        bad.validate()
    hf = to_hf_config(CFG).to_dict()
    hf["text_config"]["rope_parameters"]["mrope_interleaved"] = False
    with pytest.raises(ConfigError, match="mrope_interleaved=false"):
        read_hf_config(hf)
