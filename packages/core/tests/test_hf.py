"""longboat.core.hf: sharded safetensors round trips, key selection, transformers interop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from longboat.core.hf import SAFE_WEIGHTS_INDEX_NAME, load_safetensors, save_safetensors


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(64, 16, generator=g)
    return {
        "embed.weight": emb,
        "layers.0.w": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "layers.0.b": torch.randn(16, generator=g),
        "layers.1.w": torch.randn(16, 48, generator=g).t(),  # non-contiguous view
        "layers.1.idx": torch.arange(10, dtype=torch.int64),
        "scalar": torch.tensor(3.5, dtype=torch.float16),
        "head.weight": emb,  # tied: shares storage with embed.weight
    }


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_sharded_round_trip_is_bit_exact(tmp_path: Path) -> None:
    src = _state()
    files = save_safetensors(src, tmp_path, max_shard_bytes=2048)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(src)
    assert set(index["weight_map"].values()) == set(shards)
    expected_bytes = sum(t.numel() * t.element_size() for t in src.values())
    assert index["metadata"]["total_size"] == expected_bytes
    assert tmp_path / SAFE_WEIGHTS_INDEX_NAME in files
    _assert_equal(load_safetensors(tmp_path), src)


def test_single_file_and_selected_keys(tmp_path: Path) -> None:
    src = _state()
    save_safetensors(src, tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["model.safetensors"]
    _assert_equal(load_safetensors(tmp_path / "one" / "model.safetensors"), src)

    save_safetensors(src, tmp_path / "many", max_shard_bytes=2048)
    picked = load_safetensors(tmp_path / "many", keys=["layers.0.b", "scalar"])
    _assert_equal(picked, {k: src[k] for k in ("layers.0.b", "scalar")})
    with pytest.raises(KeyError, match="'nope'"):
        load_safetensors(tmp_path / "many", keys=["scalar", "nope"])


def test_resave_smaller_removes_stale_shards(tmp_path: Path) -> None:
    save_safetensors(_state(), tmp_path, max_shard_bytes=2048)
    small = {"x": torch.ones(3)}
    save_safetensors(small, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    _assert_equal(load_safetensors(tmp_path), small)


def test_transformers_interop_both_ways(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ref = {k: v.clone() for k, v in model.state_dict().items()}

    # transformers writes a sharded folder -> we read it
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / SAFE_WEIGHTS_INDEX_NAME).is_file()
    _assert_equal(load_safetensors(tmp_path / "hf"), ref)

    # we write a sharded folder + config -> transformers loads it
    save_safetensors(ref, tmp_path / "ours", max_shard_bytes=20_000, config=cfg)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    _assert_equal(dict(loaded.state_dict()), ref)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_safetensors_dtypes_reads_headers_only(tmp_path: Path) -> None:
    from longboat.core.hf import safetensors_dtypes

    save_safetensors({"a": torch.zeros(3), "b": torch.ones(2, dtype=torch.bfloat16)}, tmp_path)
    assert safetensors_dtypes(tmp_path) == {"F32", "BF16"}
    single = tmp_path / "one"
    save_safetensors({"c": torch.zeros(4, dtype=torch.float16)}, single)
    assert safetensors_dtypes(single) == {"F16"}
