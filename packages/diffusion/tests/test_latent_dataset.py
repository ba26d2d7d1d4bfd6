"""Latent dataset format, reader, batching and resume; the synthetic squares and previews."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from longboat.core.config.errors import ConfigError
from longboat.diffusion.data import (
    DataError,
    LatentBatchSampler,
    LatentDataset,
    LatentRecord,
    LatentsDataConfig,
    SyntheticSquaresDataConfig,
    build_latent_loader,
    caption_embedding,
    collate_latents,
    generate_squares,
    latents_to_gif,
    latents_to_rgb,
)
from longboat.diffusion.data.shards import (
    MANIFEST,
    file_sha256,
    new_manifest,
    read_manifest,
    write_manifest,
    write_shard,
)
from longboat.diffusion.data.synthetic import square_latents

SHAPES = [(1, 4, 6), (3, 4, 4), (2, 6, 4), (3, 4, 4), (1, 4, 6), (5, 2, 2), (3, 4, 4)]


def _records(n: int = len(SHAPES), c: int = 4, d: int = 8) -> list[LatentRecord]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        shape = SHAPES[i % len(SHAPES)]
        out.append(
            LatentRecord(
                latents=torch.randn(c, *shape, generator=g),
                text_embeds=torch.randn(1 + i % 5, d, generator=g),
                caption=f"caption {i} ünïcode",
                source=f"clip_{i}.mp4",
                fps=16.0,
                frames=1 + 4 * (shape[0] - 1),
                height=8 * shape[1],
                width=8 * shape[2],
            )
        )
    return out


def _write(root: Path, records: list[LatentRecord], per_shard: int, dtype: str = "float32") -> None:
    m = new_manifest(
        latent_channels=records[0].latents.shape[0],
        text_dim=records[0].text_embeds.shape[1],
        dtype=dtype,
        encoders={"vae": "test"},
        options={},
    )
    for k, start in enumerate(range(0, len(records), per_shard)):
        m["shards"].append(
            write_shard(root, k, records[start : start + per_shard], dtype).to_json()
        )
    m["complete"] = True
    write_manifest(root, m)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_exact(tmp_path: Path, dtype: str) -> None:
    recs = _records()
    _write(tmp_path, recs, per_shard=3, dtype=dtype)
    ds = LatentDataset(tmp_path, verify=True)
    assert len(ds) == len(recs)
    assert ds.shapes.tolist() == [list(s) for s in SHAPES]
    assert ds.text_lengths.tolist() == [1 + i % 5 for i in range(len(recs))]
    store = getattr(torch, dtype)
    for i, r in enumerate(recs):
        s = ds[i]
        assert torch.equal(s["latents"], r.latents.to(store))
        assert torch.equal(s["text_embeds"], r.text_embeds.to(store))
        assert s["caption"] == r.caption and s["index"] == i
        assert s["metadata"] == {
            "source": r.source,
            "fps": 16.0,
            "frames": r.frames,
            "height": r.height,
            "width": r.width,
        }
    m = read_manifest(tmp_path)
    assert (m["num_samples"], m["num_shards"]) == (7, 3)
    assert m["bytes"] == sum(p.stat().st_size for p in (tmp_path / "shards").iterdir())
    # Two directories read together.
    both = LatentDataset([tmp_path, tmp_path])
    assert len(both) == 14 and torch.equal(both[9]["latents"], ds[2]["latents"])


def test_corruption_names_the_shard_and_sample(tmp_path: Path) -> None:
    _write(tmp_path, _records(), per_shard=3)
    shard1 = tmp_path / "shards" / "shard-00001.safetensors"
    data = bytearray(shard1.read_bytes())
    # A flipped byte in the tensor data: same size, caught by the checksum.
    data[-3] ^= 0xFF
    shard1.write_bytes(bytes(data))
    # Sizes match; the checksum, checked by default, does not.
    with pytest.raises(DataError, match=r"shard-00001\.safetensors: SHA-256"):
        LatentDataset(tmp_path)
    with pytest.raises(DataError, match=r"shard-00001\.safetensors: SHA-256"):
        LatentDataset(tmp_path, verify=True)
    # Truncated.
    shard1.write_bytes(bytes(data[:-10]))
    with pytest.raises(DataError, match=r"shard-00001\.safetensors: \d+ bytes, the manifest"):
        LatentDataset(tmp_path)
    shard1.unlink()
    with pytest.raises(DataError, match=r"shard-00001\.safetensors: missing"):
        LatentDataset(tmp_path)


def test_manifest_disagreeing_with_a_sample_names_it(tmp_path: Path) -> None:
    _write(tmp_path, _records(), per_shard=3)
    m = json.loads((tmp_path / MANIFEST).read_text())
    m["shards"][0]["latent_shapes"][1] = [3, 2, 8]  # same element count as (3, 4, 4)
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    ds = LatentDataset(tmp_path)
    ds[0]
    with pytest.raises(DataError, match=r"shard-00000\.safetensors sample 1 \(dataset index 1\)"):
        ds[1]
    (tmp_path / "shards" / "shard-00002.safetensors").write_bytes(b"\x00" * 10)
    m["shards"][2]["bytes"] = 10
    m["shards"][2]["sha256"] = file_sha256(tmp_path / "shards" / "shard-00002.safetensors")
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match=r"shard-00002\.safetensors: not a readable"):
        LatentDataset(tmp_path)[6]


def test_incomplete_or_missing_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        LatentDataset(tmp_path / "nope")
    recs = _records(3)
    m = new_manifest(latent_channels=4, text_dim=8, dtype="float32", encoders={}, options={})
    m["shards"].append(write_shard(tmp_path, 0, recs, "float32").to_json())
    write_manifest(tmp_path, m)
    with pytest.raises(DataError, match="has not finished"):
        LatentDataset(tmp_path)
    assert len(LatentDataset(tmp_path, allow_incomplete=True)) == 3


def test_a_failed_shard_write_leaves_nothing_that_looks_valid(tmp_path: Path, monkeypatch) -> None:
    _write(tmp_path, _records(3), per_shard=3)
    before = (tmp_path / MANIFEST).read_bytes()
    real = os.replace

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        write_shard(tmp_path, 1, _records(2), "float32")
    monkeypatch.setattr(os, "replace", real)
    assert not (tmp_path / "shards" / "shard-00001.safetensors").exists()
    assert (tmp_path / MANIFEST).read_bytes() == before
    assert len(LatentDataset(tmp_path)) == 3


def _drain(sampler, n=None):
    out = []
    for b in sampler:
        out.append(b)
        if n is not None and len(out) == n:
            break
    return out


def test_bucket_batches_are_same_shape_cover_everything_and_resume_exactly() -> None:
    shapes = np.asarray([SHAPES[i % len(SHAPES)] for i in range(40)])
    s = LatentBatchSampler(shapes, batch_size=3, seed=5)
    epoch0 = _drain(s)
    assert sorted(i for b in epoch0 for i in b) == list(range(40))
    for b in epoch0:
        assert len({tuple(shapes[i]) for i in b}) == 1 and 1 <= len(b) <= 3
    epoch1 = _drain(s)
    assert epoch1 != epoch0 and sorted(i for b in epoch1 for i in b) == list(range(40))
    # Resume mid-epoch 1 in a fresh sampler.
    ref = LatentBatchSampler(shapes, batch_size=3, seed=5)
    _drain(ref)
    head = _drain(ref, 4)
    state = ref.state_dict()
    again = LatentBatchSampler(shapes, batch_size=3, seed=5)
    again.load_state_dict(state)
    assert head + _drain(again) == epoch1
    # ... and at world size 2: the two ranks split exactly the rest.
    ranks = [
        LatentBatchSampler(shapes, batch_size=3, seed=5, num_replicas=2, rank=r) for r in (0, 1)
    ]
    for r in ranks:
        r.load_state_dict(state)
    rest = epoch1[4:]
    got = [_drain(r) for r in ranks]
    assert got[0] == rest[0::2][: len(got[0])] and got[1] == rest[1::2][: len(got[1])]
    with pytest.raises(ValueError, match="batch_size"):
        LatentBatchSampler(shapes, batch_size=2, seed=5).load_state_dict(state)
    dropped = _drain(LatentBatchSampler(shapes, batch_size=3, seed=5, drop_last=True))
    assert all(len(b) == 3 for b in dropped)


def test_pack_batches_fit_the_token_budget() -> None:
    shapes = np.asarray([SHAPES[i % len(SHAPES)] for i in range(30)])
    tokens = np.prod(-(-shapes // np.asarray([1, 2, 2])), axis=1)
    s = LatentBatchSampler(shapes, mode="pack", max_tokens=24, seed=1)
    batches = _drain(s)
    assert sorted(i for b in batches for i in b) == list(range(30))
    assert all(tokens[b].sum() <= 24 for b in batches)
    assert any(len({tuple(shapes[i]) for i in b}) > 1 for b in batches)  # mixed shapes
    assert len(batches) <= -(-int(tokens.sum()) // 24) + 1  # best fit wastes little
    resumed = LatentBatchSampler(shapes, mode="pack", max_tokens=24, seed=1)
    head = _drain(resumed, 5)
    again = LatentBatchSampler(shapes, mode="pack", max_tokens=24, seed=1)
    again.load_state_dict(resumed.state_dict())
    assert head + _drain(again) == batches
    with pytest.raises(DataError, match=r"sample 1 .* 12 tokens, more than max_tokens=8"):
        LatentBatchSampler(shapes, mode="pack", max_tokens=8)


def test_collate_pads_and_masks_or_packs() -> None:
    recs = _records(3)
    samples = [
        {"latents": r.latents, "text_embeds": r.text_embeds, "caption": r.caption, "index": i}
        for i, r in enumerate(recs)
    ]
    b = collate_latents(samples)
    assert b["latents"].shape == (3, 4, 3, 6, 6)
    assert b["latent_shapes"].tolist() == [list(s) for s in SHAPES[:3]]
    for i, r in enumerate(recs):
        t, h, w = r.latents.shape[1:]
        assert torch.equal(b["latents"][i, :, :t, :h, :w], r.latents)
        assert int(b["latent_mask"][i].sum()) == t * h * w
        assert not b["latents"][i][:, ~b["latent_mask"][i]].any()  # zeros elsewhere
        n = r.text_embeds.shape[0]
        assert torch.equal(b["text_embeds"][i, :n], r.text_embeds)
        assert b["text_mask"][i].tolist() == [True] * n + [False] * (3 - n)
    p = collate_latents(samples, packed=True, dtype=torch.bfloat16)
    assert [tuple(x.shape) for x in p["latents"]] == [(4, *s) for s in SHAPES[:3]]
    assert "latent_mask" not in p and p["text_embeds"].dtype == torch.bfloat16


def test_synthetic_squares_loader_resumes_exactly(tmp_path: Path) -> None:
    cfg = SyntheticSquaresDataConfig(
        out_dir=str(tmp_path / "sq"), num_samples=40, shapes=[[1, 4, 4], [3, 4, 6]], text_dim=8
    )
    run = build_latent_loader(cfg, batch_size=4)
    digest = (tmp_path / "sq" / MANIFEST).read_bytes()
    assert generate_squares(cfg) == tmp_path / "sq"  # reused, not rewritten
    assert (tmp_path / "sq" / MANIFEST).read_bytes() == digest
    full = [b["indices"].tolist() for b in run.loader]
    assert sorted(i for b in full for i in b) == list(range(40))
    first = next(iter(run.loader))
    assert first["latents"].shape[1] == 16 and first["text_embeds"].shape[-1] == 8
    assert bool(first["latent_mask"].all())  # bucketed: no padding
    resumed = build_latent_loader(cfg, batch_size=4)
    it = iter(resumed.loader)
    head = [next(it)["indices"].tolist() for _ in range(3)]
    state = resumed.state_dict()
    again = build_latent_loader(cfg, batch_size=4)
    again.load_state_dict(state)
    second = [b["indices"].tolist() for b in again.loader]
    assert head == full[:3] and head + second == full
    # The next epoch reshuffles inside shapes too: other batches, in another order.
    epoch1 = [b["indices"].tolist() for b in run.loader]
    assert epoch1 != full and sorted(map(sorted, epoch1)) != sorted(map(sorted, full))


def test_synthetic_captions_embeddings_and_preview(tmp_path: Path) -> None:
    cfg = SyntheticSquaresDataConfig(out_dir=str(tmp_path / "sq"), num_samples=32, text_dim=8)
    ds = LatentDataset(generate_squares(cfg))
    caps = [ds[i]["caption"] for i in range(32)]
    assert caps[0] == "a red square" and caps[5] == "a green square"  # shape [1, 8, 8]
    assert caps[16 + 5] == "a green square moving right"
    assert torch.equal(ds[21]["text_embeds"], caption_embedding(caps[21], 8))
    e = caption_embedding("a red square moving left", 8)
    assert e.shape == (5, 8) and not torch.equal(e[1], caption_embedding("a blue square", 8)[1])
    assert torch.equal(e[:3], caption_embedding("a red square", 8))
    # Centred starts (jitter 0): samples of one colour, direction and shape are equal.
    from longboat.diffusion.data.synthetic import square_record

    fixed = SyntheticSquaresDataConfig(start_jitter=0, text_dim=8)
    anywhere = SyntheticSquaresDataConfig(start_jitter=-1, text_dim=8)
    assert torch.equal(square_record(16, fixed).latents, square_record(64, fixed).latents)
    assert not torch.equal(square_record(16, anywhere).latents, square_record(64, anywhere).latents)
    jittered = {tuple(square_record(16 + 48 * k, cfg).extra["start"]) for k in range(20)}
    assert jittered <= {(y, x) for y in (1, 2, 3) for x in (1, 2, 3)} and len(jittered) > 1
    # The preview recovers the colours exactly; the square moves one cell per frame.
    lat = square_latents((3, 8, 8), "red", "left", start=(2, 4))
    rgb = latents_to_rgb(lat)
    assert rgb.shape == (3, 8, 8, 3)
    assert rgb[0, 2, 4].tolist() == [255, 0, 0] and rgb[0, 0, 0].tolist() == [32, 32, 32]
    assert rgb[1, 2, 3].tolist() == [255, 0, 0] and rgb[1, 2, 6].tolist() == [32, 32, 32]
    assert (rgb[0].reshape(-1, 3) == [255, 0, 0]).all(axis=1).sum() == 9  # side 3
    from PIL import Image

    path = latents_to_gif(torch.stack([lat, lat]), tmp_path / "p.gif", scale=4)
    with Image.open(path) as img:
        assert img.n_frames == 3 and img.size == (4 * 17, 32)
        img.seek(1)
        frame = np.asarray(img.convert("RGB"))
        assert frame[2 * 4, 3 * 4].tolist() == [255, 0, 0]


def test_data_configs_name_every_bad_key() -> None:
    with pytest.raises(ConfigError) as err:
        LatentsDataConfig(batching="packed", patch_size=[1, 2], dtype="int8").validate()
    assert set(err.value.keys) == {"data.paths", "data.batching", "data.patch_size", "data.dtype"}
    with pytest.raises(ConfigError) as err:
        LatentsDataConfig(paths=["x"], batching="pack").validate("run.data")
    assert err.value.keys == ["run.data.max_tokens"]
    LatentsDataConfig(path="one_dir").validate()  # core's single path counts too
    with pytest.raises(ConfigError) as err:
        SyntheticSquaresDataConfig(
            num_samples=0, shapes=[[1, 3, 8]], latent_channels=2, start_jitter=-2
        ).validate()
    assert set(err.value.keys) == {
        "data.num_samples",
        "data.shapes",
        "data.latent_channels",
        "data.start_jitter",
    }
    SyntheticSquaresDataConfig().validate()
