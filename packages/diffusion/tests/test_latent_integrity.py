"""Latent shards are checked by default: a corrupted shard, a NaN / Inf sample and a shard
path outside the dataset folder are refused naming them before any training."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from longboat.diffusion.data import DataError, LatentDataset, LatentRecord
from longboat.diffusion.data import integrity as integrity_module
from longboat.diffusion.data.shards import MANIFEST, new_manifest, write_manifest, write_shard


def _records(n: int, bad: dict[int, float] | None = None) -> list[LatentRecord]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        latents = torch.randn(4, 1, 4, 4, generator=g)
        if bad and i in bad:
            latents[1, 0, 2, 3] = bad[i]
        out.append(
            LatentRecord(
                latents=latents,
                text_embeds=torch.randn(3, 8, generator=g),
                caption=f"c{i}",
                source=f"s{i}",
            )
        )
    return out


def _write(root: Path, records: list[LatentRecord], per_shard: int = 3) -> None:
    m = new_manifest(latent_channels=4, text_dim=8, dtype="float32", encoders={}, options={})
    for k, start in enumerate(range(0, len(records), per_shard)):
        m["shards"].append(
            write_shard(root, k, records[start : start + per_shard], "float32").to_json()
        )
    m["complete"] = True
    write_manifest(root, m)


def _flip(path: Path, n: int = 1000, keep_mtime: bool = False) -> None:
    stat = path.stat()
    data = bytearray(path.read_bytes())
    for i in range(len(data) - n, len(data)):  # tensor bytes at the end: same size
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_corrupted_shard_is_refused_by_default(tmp_path: Path) -> None:
    _write(tmp_path, _records(6))
    assert len(LatentDataset(tmp_path)) == 6  # checked and cached
    shard = tmp_path / "shards" / "shard-00001.safetensors"
    _flip(shard, 100)
    with pytest.raises(DataError, match=r"shard-00001\.safetensors: SHA-256 differs") as err:
        LatentDataset(tmp_path)
    assert err.value.exit_code == 2


def test_an_unchanged_dataset_is_read_once_and_verify_reads_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, _records(6))
    LatentDataset(tmp_path)
    cache = json.loads((tmp_path / integrity_module.CHECK_CACHE).read_text())
    assert sorted(cache) == ["shards/shard-00000.safetensors", "shards/shard-00001.safetensors"]

    def no_reads(path: Path) -> str:
        raise AssertionError(f"read {path}")

    monkeypatch.setattr(integrity_module, "file_sha256", no_reads)
    assert len(LatentDataset(tmp_path)) == 6  # from the cache: no shard byte read
    monkeypatch.undo()
    # Bit rot that leaves size and mtime alone is found by data.verify=true only.
    _flip(tmp_path / "shards" / "shard-00000.safetensors", 64, keep_mtime=True)
    assert len(LatentDataset(tmp_path)) == 6
    with pytest.raises(DataError, match=r"shard-00000\.safetensors: SHA-256 differs"):
        LatentDataset(tmp_path, verify=True)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_latent_is_named_and_refused_or_skipped(tmp_path: Path, value: float) -> None:
    _write(tmp_path, _records(6, bad={4: value}))
    with pytest.raises(DataError) as err:
        LatentDataset(tmp_path)
    text = str(err.value)
    assert "shard-00001.safetensors sample 1 (dataset index 4): latents holds NaN or Inf" in text
    assert "data.skip_bad_samples=true" in text
    with pytest.warns(UserWarning, match=r"left out 1 sample\(s\) holding NaN or Inf"):
        ds = LatentDataset(tmp_path, skip_bad_samples=True)
    assert len(ds) == 5 and len(ds.shapes) == len(ds.text_lengths) == 5
    assert ds.skipped == [
        f"{tmp_path / 'shards' / 'shard-00001.safetensors'} sample 1 (dataset index 4): "
        "latents holds NaN or Inf"
    ]
    assert [ds[i]["caption"] for i in range(5)] == ["c0", "c1", "c2", "c3", "c5"]
    assert all(bool(torch.isfinite(ds[i]["latents"]).all()) for i in range(5))


def test_every_sample_bad_is_refused_even_when_skipping(tmp_path: Path) -> None:
    _write(tmp_path, _records(2, bad={0: float("nan"), 1: float("-inf")}))
    with pytest.raises(DataError, match="every sample"):
        LatentDataset(tmp_path, skip_bad_samples=True)


def test_a_shard_path_outside_the_dataset_folder_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _write(root, _records(3))
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes((root / "shards" / "shard-00000.safetensors").read_bytes())
    m = json.loads((root / MANIFEST).read_text())
    m["shards"][0]["file"] = "../elsewhere.safetensors"
    (root / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match=r"shard file '\.\./elsewhere\.safetensors' resolves to"):
        LatentDataset(root)
    m["shards"][0]["file"] = str(outside)  # an absolute path
    (root / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match="outside the dataset folder"):
        LatentDataset(root)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", "folder"])
def test_a_non_utf8_input_list_names_the_line(tmp_path: Path, suffix: str) -> None:
    from longboat.diffusion.data.sources import list_sources

    if suffix == ".jsonl":
        bad = tmp_path / "in.jsonl"
        bad.write_bytes(
            b'{"path": "a.png", "caption": "ok"}\n{"path": "b.png", "caption": "\xff"}\n'
        )
        given, line = bad, 2
    elif suffix == ".csv":
        bad = tmp_path / "in.csv"
        bad.write_bytes(b"path,caption\na.png,ok\nb.png,caf\xe9\n")
        given, line = bad, 3
    else:
        given = tmp_path / "media"
        given.mkdir()
        (given / "a.png").write_bytes(b"")
        bad = given / "a.txt"
        bad.write_bytes(b"a red \xff square")
        line = 1
    with pytest.raises(DataError, match=rf"^{bad} line {line}: not UTF-8 text \(byte 0x"):
        list_sources(given)


def test_inspect_lists_the_samples_holding_nan(tmp_path: Path) -> None:
    from longboat.diffusion.data.inspection import inspect_dataset

    _write(tmp_path, _records(6, bad={2: float("nan")}))
    text = inspect_dataset(tmp_path, captions=1)
    assert "5 samples in 2 shards" in text
    assert "samples holding NaN / Inf (left out above; training refuses them unless" in text
    assert "shard-00000.safetensors sample 2 (dataset index 2): latents holds NaN" in text
