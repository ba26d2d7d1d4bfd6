"""The Qwen3-VL families' FLOP count (``qwen3_vl.flops``, the benchmarks' MFU) against the
matrix FLOPs ``torch.utils.flop_counter`` counts in transformers' forward (CPU, tiny).

transformers runs eager attention (``Q K^T`` and ``A V`` as matmuls, so the counter sees them;
the causal decoder's are counted over the whole square, twice the causal count of the
formula) and its per-expert loop for the MoE decoder (each expert's matrices over the tokens
routed to it: exactly ``moe_topk`` experts a token). The counter also sees the text rotary's
small ``inv_freq @ positions`` product, which the formula leaves out: the two agree within
0.5%. Counting all 8 experts instead of the top 2 (+33%), leaving out the mergers (-18%) or
the causal halving (+1.5%) each moves the count outside that."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from longboat.core.family import find_family
from longboat.vlm.models.mrope import token_types

GRIDS = [[1, 8, 12], [1, 4, 4]]  # two images, 24 + 4 merged tokens


def _hf_forward_flops(family: str, cfg: object) -> tuple[float, int]:
    """(forward matrix FLOPs of transformers' model of ``cfg`` on a text + two images
    sample, the sample's tokens)."""
    impl = find_family("vlm", family).load()
    hf_cfg = impl.to_hf_config(cfg)
    hf_cfg._attn_implementation = "eager"
    hf_cfg._experts_implementation = "eager"  # the counter has no formula for grouped GEMMs
    import transformers

    name = (
        "Qwen3VLMoeForConditionalGeneration"
        if "moe" in family
        else "Qwen3VLForConditionalGeneration"
    )
    torch.manual_seed(0)
    model = getattr(transformers, name)(hf_cfg).eval()
    mu = cfg.vision.merge_unit
    ids = list(range(5))
    for t, h, w in GRIDS:
        ids += [cfg.vision_start_token_id, *[cfg.image_token_id] * (t * h * w // mu)]
        ids += [cfg.vision_end_token_id, *range(7)]
    input_ids = torch.tensor([ids])
    grid = torch.tensor(GRIDS)
    pixels = torch.randn(int(grid.prod(-1).sum()), cfg.vision.patch_dim)
    types = token_types(input_ids, cfg.image_token_id, cfg.video_token_id).int()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types,
              use_cache=False)  # fmt: skip
    return float(counter.get_total_flops()), len(ids)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_forward_flops_equal_transformers_matrix_flops(family: str) -> None:
    fam = find_family("vlm", family)
    cfg = fam.load().flavor("tiny")
    if family == "qwen3_vl_moe":  # more experts than the top-k, so the two counts differ
        cfg = dataclasses.replace(cfg, language=dataclasses.replace(cfg.language, num_experts=8))
    measured, tokens = _hf_forward_flops(family, cfg)
    m = cfg.language
    square = 2 * tokens * tokens * m.num_attention_heads * m.head_dim * m.num_layers
    counted = fam.flops_per_sample(cfg, tokens, GRIDS) / 3 + square  # eager: the whole square
    assert counted == pytest.approx(measured, rel=5e-3)
