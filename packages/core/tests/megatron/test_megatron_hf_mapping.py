"""Megatron <-> HF tensor mapping: each TP rank reads only its slice; shards reassemble exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs longboat-core[megatron]")

from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.hf_mapping import (
    RankCoords,
    expected_hf_shapes,
    megatron_to_hf_slot,
    shard_from_hf,
    unshard_to_hf,
)

ARCH = DecoderModelConfig(
    norm_eps=1e-6,
    max_position_embeddings=4096,
    vocab_size=32,
    hidden_size=16,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=4,
    ffn_hidden_size=24,
    qk_norm=True,
    num_experts=4,
    moe_ffn_hidden_size=8,
)
NAMES = [
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "decoder.final_layernorm.weight",
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.self_attention.linear_proj.weight",
    "decoder.layers.0.self_attention.q_layernorm.weight",
    "decoder.layers.0.mlp.router.weight",
    "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
]


def _hf_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in expected_hf_shapes(ARCH).items()}


def _reader(hf: dict[str, torch.Tensor], coords: RankCoords, log: list):
    def read(name: str, rows, cols):
        t = hf[name]
        if t.dim() == 1:
            log.append((name, rows, None))
            return t[rows]
        if cols == "tp":
            per = t.shape[1] // coords.tp_size
            cols = slice(coords.tp_rank * per, (coords.tp_rank + 1) * per)
        log.append((name, rows, cols))
        return t[rows, cols]

    return read


def test_rank_reads_only_its_rows_of_q_k_v() -> None:
    hf, log = _hf_tensors(), []
    coords = RankCoords(tp_rank=1, tp_size=2)
    slot = megatron_to_hf_slot(
        "decoder.layers.1.self_attention.linear_qkv.weight", ARCH, global_layer=1, ep=coords
    )
    shard = shard_from_hf(slot, _reader(hf, coords, log), ARCH, coords)
    # rank 1 of 2 owns query group 1: q rows 8..16 (2 heads x 4), k / v rows 4..8.
    assert [(n.split(".")[-2], r) for n, r, _ in log] == [
        ("q_proj", slice(8, 16)),
        ("k_proj", slice(4, 8)),
        ("v_proj", slice(4, 8)),
    ]
    p = "model.layers.1.self_attn."
    want = torch.cat(
        [hf[p + "q_proj.weight"][8:16], hf[p + "k_proj.weight"][4:8], hf[p + "v_proj.weight"][4:8]]
    )
    assert torch.equal(shard, want)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_shards_reassemble_bit_exactly(name: str, tp: int) -> None:
    hf = _hf_tensors()
    layer = 0 if name.startswith("decoder.layers") else None
    shards, slot = [], None
    for rank in range(tp):
        coords = RankCoords(tp_rank=rank, tp_size=tp, ep_rank=1, ep_size=2)
        slot = megatron_to_hf_slot(name, ARCH, global_layer=layer, ep=coords)
        shards.append(shard_from_hf(slot, _reader(hf, coords, []), ARCH, coords))
    if slot.kind in ("replicated", "expert_full", "expert_gate_up"):
        assert all(torch.equal(s, shards[0]) for s in shards)
        shards = shards[:1]
    for hf_name, tensor in unshard_to_hf(slot, shards, ARCH).items():
        assert torch.equal(tensor, hf[hf_name]), hf_name


def test_expert_parallel_rank_maps_to_global_experts() -> None:
    coords = RankCoords(ep_rank=1, ep_size=2)
    slot = megatron_to_hf_slot(
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
        ARCH,
        global_layer=0,
        ep=coords,
    )
    assert slot.hf_names == ("model.layers.0.mlp.experts.2.down_proj.weight",)


def test_tied_head_maps_to_the_embedding() -> None:
    tied = DecoderModelConfig(**{**ARCH.__dict__, "tie_embeddings": True})
    slot = megatron_to_hf_slot("output_layer.weight", tied, global_layer=None, ep=RankCoords())
    assert slot.hf_names == ("model.embed_tokens.weight",)
    assert "lm_head.weight" not in expected_hf_shapes(tied)


def test_fused_layouts_match_megatron_by_hand() -> None:
    """The round trip above cannot see a layout that is wrong both ways; pin the layouts.

    linear_qkv interleaves per query group ([q_g, k_g, v_g] for each group g of the rank);
    with one group per rank (tp=2 above) interleaved and blocked layouts coincide, so check
    tp=1 with both groups. linear_fc1 is this rank's gate rows, then its up rows.
    """
    hf = _hf_tensors()
    coords = RankCoords()
    slot = megatron_to_hf_slot(
        "decoder.layers.0.self_attention.linear_qkv.weight", ARCH, global_layer=0, ep=coords
    )
    shard = shard_from_hf(slot, _reader(hf, coords, []), ARCH, coords)
    q, k, v = (hf[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    # 4 heads in 2 groups of 2 heads, head_dim 4: q rows 8 per group, k / v rows 4.
    want = torch.cat([q[0:8], k[0:4], v[0:4], q[8:16], k[4:8], v[4:8]])
    assert torch.equal(shard, want)

    dense = DecoderModelConfig(**{**ARCH.__dict__, "num_experts": 0, "moe_ffn_hidden_size": None})
    g = torch.Generator().manual_seed(1)
    hf = {n: torch.randn(s, generator=g) for n, s in expected_hf_shapes(dense).items()}
    coords = RankCoords(tp_rank=1, tp_size=2)
    slot = megatron_to_hf_slot(
        "decoder.layers.1.mlp.linear_fc1.weight", dense, global_layer=1, ep=coords
    )
    shard = shard_from_hf(slot, _reader(hf, coords, []), dense, coords)
    gate, up = (hf[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up"))
    assert torch.equal(shard, torch.cat([gate[12:24], up[12:24]]))  # ffn 24 over 2 ranks


@pytest.mark.parametrize("released", [False, True])
@pytest.mark.parametrize(
    "name",
    [
        "decoder.layers.1.mlp.experts.linear_fc1.weight",  # grouped: the rank's experts stacked
        "decoder.layers.1.mlp.experts.linear_fc2.weight",
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight",  # sequential: one
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight",
    ],
)
def test_fused_experts_read_either_orientation(name: str, released: bool) -> None:
    """``expert_layout="fused"``: EP rank 1 of 2 reads experts 2..3 (or expert 3) of a layer's
    fused tensor, stored as transformers holds it or transposed as the released files are;
    the export orientation puts it back where the two differ in shape."""
    from longboat.core.megatron.hf_mapping import fused_experts_for_file

    shapes = expected_hf_shapes(ARCH, expert_layout="fused")
    p = "model.layers.1.mlp.experts."
    assert shapes[p + "gate_up_proj"] == (4, 16, 16) and shapes[p + "down_proj"] == (4, 16, 8)
    assert not any(".experts.0." in n for n in shapes)
    hf = _hf_tensors()
    g = torch.Generator().manual_seed(2)
    memory = {n: torch.randn(shapes[n], generator=g) for n in (p + "gate_up_proj", p + "down_proj")}
    stored = {n: fused_experts_for_file(t) if released else t for n, t in memory.items()}
    assert stored[p + "down_proj"].shape == ((4, 8, 16) if released else (4, 16, 8))
    coords = RankCoords(ep_rank=1, ep_size=2)
    slot = megatron_to_hf_slot(name, ARCH, global_layer=1, ep=coords, expert_layout="fused")
    shard = shard_from_hf(slot, _reader({**hf, **stored}, coords, []), ARCH, coords)
    full = memory[slot.hf_names[0]]
    if ".local_experts." in name:
        assert slot.experts == (3,) and torch.equal(shard, full[3])
    else:
        assert slot.experts == (2, 3) and torch.equal(shard, full[2:4])
