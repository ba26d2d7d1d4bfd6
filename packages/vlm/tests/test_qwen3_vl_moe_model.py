"""Qwen3-VL-MoE logits and load-balancing terms == transformers' (CPU, fp32, tiny config,
random weights, no downloads).

A tiny ``Qwen3VLMoeForConditionalGeneration`` is built from our ``tiny`` flavor's HF config
(the 3-block Qwen3-VL tower with two deepstack mergers over a 2-layer Qwen3-MoE decoder of
4 experts, top-2) and saved; longboat reads the directory, loads it into megatron gloo
workers (one process, and expert parallel over two) and compares logits for text only, an
image and a video with an image, and each layer's load-balancing term (megatron's, from a
training forward) against transformers' of that layer's router logits. The export (each
layer's experts gathered over the expert-parallel ranks) is loaded back with
``transformers`` and gives the same logits; a checkpoint whose fused experts are stored in
the released orientation (``[E, H, 2F]``, ``[E, F, H]``) loads to the same model (into
megatron's sequential experts too); TP=2 (inference) and a 4-layer decoder over two
pipeline stages give the same logits / loss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from longboat.core.distributed import run_multiprocess
from longboat.vlm.models.mrope import token_types
from longboat.vlm.models.qwen3_vl_moe.model import (
    compose,
    flavor,
    read_hf_config,
    to_hf_config,
)

TOL = 1e-4  # max abs logit difference vs transformers (fp32)
EP_TOL = 1e-5  # EP=2 / TP=2 vs one process
CFG = flavor("tiny")
V, L = CFG.vision, CFG.language
IMG, VID, VS, VE = (
    CFG.image_token_id,
    CFG.video_token_id,
    CFG.vision_start_token_id,
    CFG.vision_end_token_id,
)
CASES = ("text", "one_image", "video")


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
    elif name == "video":
        videos = [[2, 8, 8]]
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
            pv = torch.randn(int(gt.prod(-1).sum()), V.patch_dim, generator=g)
            out["pixel_values" if key == "image" else "pixel_values_videos"] = pv
            out[f"{key}_grid_thw"] = gt
    return out


def _hf_forward(model: Any, batch: dict[str, Any]) -> Any:
    types = token_types(batch["input_ids"], IMG, VID).int()
    with torch.no_grad():
        return model(**batch, mm_token_type_ids=types, output_router_logits=True)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf_cfg = to_hf_config(CFG)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3VLMoeForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():  # norms away from 1, routers sharp enough to pick distinct experts
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.08)
            if "norm" in name:
                p.add_(1.0)
            if "pos_embed" in name or "mlp.gate." in name:
                p.mul_(10.0)
    out = tmp_path_factory.mktemp("qwen3_vl_moe_tiny")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(hf_dir: Path) -> dict[str, Any]:
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(hf_dir, attn_implementation="sdpa")
    model.eval()
    out: dict[str, Any] = {}
    for i, name in enumerate(CASES):
        result = _hf_forward(model, _case(name, i))
        out[name] = result.logits
        # transformers' load-balancing term of each layer's router logits alone
        out[f"{name}_balance"] = torch.stack(
            [
                load_balancing_loss_func((g,), L.num_experts, L.moe_topk)
                for g in result.router_logits
            ]
        )
        out[f"{name}_aux"] = result.aux_loss
    return out


def _worker(
    rank: int,
    world: int,
    hf_dir: Path,
    ep: int,
    export: Path | None,
    tp: int = 1,
    experts: str = "auto",
) -> dict[str, Any]:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.hf_io import rank_coords, tp_shards
    from longboat.vlm.models.qwen3_vl_moe.model import build, load_hf, save_hf

    cfg = read_hf_config(hf_dir)
    cfg.language.moe_experts = experts  # auto: grouped (stacked) experts where torch has them
    layout = ParallelConfig(expert_parallel=ep, tensor_parallel=tp)
    parallel_state.initialize(layout, get_accelerator("cpu"))
    try:
        model = build(cfg)
        load_hf(model, cfg, hf_dir)
        out: dict[str, Any] = {}
        tracker = get_moe_metrics_tracker()
        for i, name in enumerate(CASES):
            model.eval()
            with torch.no_grad():  # the vocabulary's TP shards gathered
                out[name] = torch.cat(tp_shards(model(**_case(name, i)), rank_coords()), dim=-1)
            if tp > 1:  # megatron trains MoE under TP only with sequence parallelism
                continue
            # a training forward records megatron's per-layer load-balancing term
            model.train()
            tracker.clear()
            model(**_case(name, i))
            out[f"{name}_balance"] = tracker.metrics["load_balancing_loss"].values.clone()
        if export is not None:
            save_hf(model, cfg, export)
        return out
    finally:
        parallel_state.destroy()


@pytest.fixture(scope="module")
def ours(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    export = tmp_path_factory.mktemp("qwen3_vl_moe_export")
    out = run_multiprocess(_worker, 1, hf_dir, 1, export, timeout=300)[0]
    out["export"] = export
    return out


def _check_logits(got: dict[str, Any], reference: dict[str, Any], what: str) -> None:
    for name in CASES:
        diff = (got[name] - reference[name]).abs().max().item()
        assert diff < TOL, f"{name} ({what}): max |dlogit| {diff:.2e} >= {TOL}"


def test_logits_match_transformers(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    _check_logits(ours, reference, "one process")
    assert reference["one_image"].abs().max() > 0.1


def test_load_balancing_terms_match_transformers(
    ours: dict[str, Any], reference: dict[str, Any]
) -> None:
    """megatron's term of layer l is transformers' term of layer l's router logits / top-k
    (f_e counts top-k slots per token there, per token-slot here)."""
    for name in CASES:
        want = reference[f"{name}_balance"] / L.moe_topk
        got = ours[f"{name}_balance"]
        assert got.shape == want.shape == (L.num_layers,)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"{name}: {got} vs {want}"
        # an unbalanced router scores above the uniform optimum (1 per layer)
        assert float(want.max()) > 1.0 + 1e-3
        # transformers' pooled term of the same logits, as its model reports it
        assert float(reference[f"{name}_aux"]) > 0


def test_export_reloads_in_transformers(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    state = load_file(str(ours["export"] / "model.safetensors"))
    e, f, h = L.num_experts, L.moe_ffn_hidden_size, L.hidden_size
    # transformers' orientation where the two are the same shape, else the released one
    assert state["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (e, 2 * f, h)
    assert state["model.language_model.layers.0.mlp.experts.down_proj"].shape == (e, f, h)
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        ours["export"], attn_implementation="sdpa"
    ).eval()
    for i, name in enumerate(CASES):
        diff = (_hf_forward(reloaded, _case(name, i)).logits - reference[name]).abs().max().item()
        assert diff < TOL, f"export, {name}: max |dlogit| {diff:.2e} after the round trip"


def test_released_orientation_into_sequential_experts(
    hf_dir: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    """The released files store ``down_proj`` as ``[E, F, H]``; megatron's
    one-linear-per-expert layout (``moe_experts=sequential``, e.g. for LoRA on the experts)
    reads it to the same model and exports the same fused tensors."""
    import shutil

    released = tmp_path / "released"
    shutil.copytree(hf_dir, released)
    state = load_file(str(released / "model.safetensors"))
    for name in list(state):
        if name.endswith("mlp.experts.down_proj"):
            state[name] = state[name].transpose(1, 2).contiguous()
    save_file(state, str(released / "model.safetensors"), metadata={"format": "pt"})
    export = tmp_path / "export"
    got = run_multiprocess(_worker, 1, released, 1, export, 1, "sequential", timeout=300)[0]
    _check_logits(got, reference, "released orientation, sequential experts")
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(export).eval()
    diff = (_hf_forward(reloaded, _case("video", 2)).logits - reference["video"]).abs().max()
    assert diff.item() < TOL, f"sequential export: max |dlogit| {diff.item():.2e}"


@pytest.mark.multiprocess
def test_ep2_matches_one_process_and_transformers(
    hf_dir: Path, reference: dict[str, Any], ours: dict[str, Any], tmp_path: Path
) -> None:
    export = tmp_path / "export"
    outs = run_multiprocess(_worker, 2, hf_dir, 2, export, timeout=300)
    for rank, got in enumerate(outs):
        _check_logits(got, reference, f"EP=2 rank {rank}")
        for name in CASES:
            diff = (got[name] - ours[name]).abs().max().item()
            assert diff < EP_TOL, f"EP=2 rank {rank}, {name}: {diff:.2e} vs one process"
            assert torch.allclose(got[f"{name}_balance"], ours[f"{name}_balance"], atol=1e-6)
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(export).eval()
    diff = (_hf_forward(reloaded, _case("video", 2)).logits - reference["video"]).abs().max()
    assert diff.item() < TOL, f"EP=2 export: max |dlogit| {diff.item():.2e}"


@pytest.mark.multiprocess
def test_tp2_matches_one_process_and_transformers(
    hf_dir: Path, reference: dict[str, Any], ours: dict[str, Any], tmp_path: Path
) -> None:
    """TP=2 (inference: megatron trains MoE layers under TP only with sequence parallelism,
    which the run refuses): attention and vocabulary sharded, each rank's experts whole
    (expert tensor parallel 1); the export gathers the shards."""
    export = tmp_path / "export"
    outs = run_multiprocess(_worker, 2, hf_dir, 1, export, 2, timeout=300)
    for rank, got in enumerate(outs):
        _check_logits(got, reference, f"TP=2 rank {rank}")
        for name in CASES:
            diff = (got[name] - ours[name]).abs().max().item()
            assert diff < EP_TOL, f"TP=2 rank {rank}, {name}: {diff:.2e} vs one process"
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(export).eval()
    diff = (_hf_forward(reloaded, _case("one_image", 1)).logits - reference["one_image"]).abs()
    assert diff.max().item() < TOL, f"TP=2 export: max |dlogit| {diff.max().item():.2e}"


def test_config_round_trip(hf_dir: Path) -> None:
    """config.json -> ours -> HF config -> ours is the identity; the 30B-A3B flavor too."""
    cfg = read_hf_config(hf_dir)
    assert cfg.architecture() == CFG.architecture()
    assert read_hf_config(to_hf_config(cfg).to_dict()) == cfg
    big = flavor("30b_a3b")
    assert read_hf_config(to_hf_config(big).to_dict()).architecture() == big.architecture()


def test_one_line_swaps_the_decoder() -> None:
    """``model/llm@model.language=<decoder>``: the decoder's flavor and overrides, the
    mergers' width following it, the family's M-RoPE sections kept."""
    from longboat.core.config.errors import ConfigError

    cfg = compose(CFG, language={"name": "qwen3_moe", "flavor": "tiny", "vocab_size": 384,
                                 "hidden_size": 96, "moe_topk": 1})  # fmt: skip
    assert cfg.language.hidden_size == cfg.vision.out_hidden_size == 96
    assert cfg.language.moe_topk == 1 and cfg.language.mrope_section == [4, 2, 2]
    with pytest.raises(ConfigError, match="this family's decoder is qwen3_moe"):
        compose(CFG, language={"name": "qwen3", "flavor": "tiny", "vocab_size": 384})
    with pytest.raises(ConfigError, match="moe_norm_topk_prob=false"):
        compose(CFG, language={"moe_norm_topk_prob": False})
    with pytest.raises(ConfigError, match=r"model\.language\.bogus"):
        compose(CFG, language={"bogus": 1})


def test_30b_a3b_parameter_count_matches_transformers() -> None:
    """The flavor's HF config builds transformers' model of Qwen3-VL-30B-A3B's size."""
    from longboat.core.megatron.hf_mapping import expected_hf_shapes

    big = flavor("30b_a3b")
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(to_hf_config(big))
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    language = expected_hf_shapes(
        big.language, prefix="model.language_model.", expert_layout="fused"
    )
    for name, shape in language.items():
        assert theirs[name] == shape, name
    total = sum(torch.Size(s).numel() for s in theirs.values())
    assert 31.0e9 < total < 31.2e9, total  # 30.5B decoder + 0.6B tower, as released


def _microbatch(batch: dict[str, Any]) -> dict[str, Any]:
    """A training row of ``batch``: every next token a target."""
    ids = batch["input_ids"]
    labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    mask = torch.ones(ids.shape, dtype=torch.float32)
    mask[:, -1] = 0
    return {**batch, "labels": labels, "loss_mask": mask}


PP_SEEDS = (2, 5)  # rows of one shape (the stages exchange one activation shape)


def _pp_worker(rank: int, world: int, hf_dir: Path, export: Path) -> float:
    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.vlm.models.qwen3_vl_moe.model import build, load_hf, save_hf
    from longboat.vlm.train.step import VLMTrainStep

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(pipeline_parallel=2), get_accelerator("cpu"))
    try:
        model = build(cfg)  # stage 0: the tower, the embedding and both deepstack layers
        assert (model.vision is not None) == (rank == 0)
        load_hf(model, cfg, hf_dir)
        step = VLMTrainStep(model, OptimConfig(), precision="fp32")
        loss = step.evaluate([_microbatch(_case("video", seed)) for seed in PP_SEEDS])
        save_hf(model, cfg, export)
        return loss
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_pp2_matches_transformers(tmp_path: Path) -> None:
    """A 4-layer decoder over two pipeline stages (the first holds both deepstack layers):
    the 1F1B evaluation's loss equals transformers', and each stage's export shard (its
    layers' fused experts) reloads to the same logits."""
    import json

    four = compose(CFG, language={"num_layers": 4})
    hf_cfg = to_hf_config(four)
    torch.manual_seed(1)
    model = Qwen3VLMoeForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.08)
            if "norm" in name:
                p.add_(1.0)
    src = tmp_path / "src"
    model.save_pretrained(src)
    num = den = 0.0
    logits = {}
    for seed in PP_SEEDS:
        batch = _case("video", seed)
        logits[seed] = _hf_forward(model, batch).logits
        ids = batch["input_ids"]
        ce = torch.nn.functional.cross_entropy(logits[seed][0, :-1], ids[0, 1:], reduction="sum")
        num, den = num + float(ce), den + ids.shape[1] - 1
    export = tmp_path / "export"
    for got in run_multiprocess(_pp_worker, 2, src, export, timeout=300):
        assert abs(got - num / den) < 1e-5 * (num / den), f"PP=2 eval loss {got} vs {num / den}"
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2, "one shard per pipeline stage"
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(export).eval()
    diff = (_hf_forward(reloaded, _case("video", 2)).logits - logits[2]).abs().max()
    assert diff.item() < TOL, f"PP=2 export: max |dlogit| {diff.item():.2e}"
