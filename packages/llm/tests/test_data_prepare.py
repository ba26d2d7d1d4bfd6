"""``data prepare`` / ``IndexedTokenDataset``: formats, rerun skip, atomicity, bad inputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longboat.llm.data import IncompleteDatasetError, IndexedTokenDataset
from longboat.llm.data.cli import data_main
from longboat.llm.data.encoding import load_tokenizer
from longboat.llm.data.prepare import PrepareOptions, prepare_dataset
from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bears"


def _texts(n: int = 60) -> list[str]:
    w = WORDS.split()
    return [" ".join(w[(i + j) % len(w)] for j in range(3 + i % 11)) + f" {i}." for i in range(n)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_tokenizer(_texts(), tmp_path_factory.mktemp("tok") / "tok")


def _jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def _prepare(inp: Path, tok: Path, out: Path, **kw) -> tuple:  # type: ignore[no-untyped-def]
    logs: list[str] = []
    res = prepare_dataset(
        PrepareOptions(input=inp, tokenizer=tok, output=out, **kw), log=logs.append, progress=False
    )
    return res, logs


def _hf_dir(path: Path, texts: list[str]) -> Path:
    """A ``datasets.save_to_disk`` layout: Arrow IPC stream shards + state/info JSON."""
    path.mkdir()
    table = pa.table({"text": texts, "id": list(range(len(texts)))})
    half = len(texts) // 2
    for i, part in enumerate((table.slice(0, half), table.slice(half))):
        file = path / f"data-{i:05d}-of-00002.arrow"
        with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as writer:
            for batch in part.to_batches(max_chunksize=7):
                writer.write_batch(batch)
    (path / "dataset_info.json").write_text(json.dumps({"features": {"text": {}, "id": {}}}))
    (path / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": f"data-{i:05d}-of-00002.arrow"} for i in (0, 1)]})
    )
    return path


def test_jsonl_parquet_and_hf_dir_give_the_same_tokens(tok_dir: Path, tmp_path: Path) -> None:
    texts = _texts()
    tok = load_tokenizer(tok_dir)
    expected = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    pq.write_table(pa.table({"text": texts}), tmp_path / "in.parquet", row_group_size=16)
    inputs = {
        "jsonl": _jsonl(tmp_path / "in.jsonl", texts),
        "parquet": tmp_path / "in.parquet",
        "hf": _hf_dir(tmp_path / "hf", texts),
    }
    for name, inp in inputs.items():
        workers = 2 if name == "jsonl" else 1
        res, _ = _prepare(inp, tok_dir, tmp_path / f"out_{name}", workers=workers, chunk_size=7)
        ds = IndexedTokenDataset(res.path)
        assert len(ds) == len(texts) and ds.dtype == np.uint16, name
        assert [ds[i].tolist() for i in range(len(ds))] == expected, name
        assert ds.num_tokens == sum(map(len, expected))
        assert tok.decode(ds[5].tolist()) == texts[5] + "<|endoftext|>"
        m = ds.manifest
        assert m["report"] == {"records": 60, "docs": 60, "skipped_null": 0, "skipped_empty": 0}
        assert m["fingerprint"]["tokenizer"]["sha256"] and m["fingerprint"]["input"][0]["size"] > 0


def test_rerun_is_skipped_force_rebuilds_other_input_refused(tok_dir: Path, tmp_path: Path) -> None:
    inp, out = _jsonl(tmp_path / "a.jsonl", _texts(20)), tmp_path / "out"
    first, _ = _prepare(inp, tok_dir, out)
    assert not first.skipped
    mtime = (out / "tokens.bin").stat().st_mtime_ns
    again, logs = _prepare(inp, tok_dir, out)
    assert again.skipped and "up to date" in logs[-1]
    assert (out / "tokens.bin").stat().st_mtime_ns == mtime
    forced, logs = _prepare(inp, tok_dir, out, force=True)
    assert not forced.skipped and "--force" in logs[-1]
    _jsonl(inp, _texts(21))  # changed input: size/mtime differ
    with pytest.raises(FileExistsError, match="--force"):
        _prepare(inp, tok_dir, out)
    assert len(IndexedTokenDataset(out)) == 20  # the old dataset is untouched
    assert len(IndexedTokenDataset(_prepare(inp, tok_dir, out, force=True)[0].path)) == 21
    assert not list(tmp_path.glob(".out.*"))  # no temp or old dirs left behind


def test_dir_without_manifest_is_not_finished_and_is_rebuilt(tok_dir: Path, tmp_path: Path) -> None:
    inp, out = _jsonl(tmp_path / "a.jsonl", _texts(10)), tmp_path / "out"
    _prepare(inp, tok_dir, out)
    (out / "manifest.json").unlink()  # as if a build died before its manifest
    with pytest.raises(IncompleteDatasetError, match=r"no manifest\.json"):
        IndexedTokenDataset(out)
    stale = tmp_path / ".out.tmp-999999999"  # a leftover temp dir of a dead process
    stale.mkdir()
    (stale / "tokens.bin").write_bytes(b"\0" * 10)
    res, logs = _prepare(inp, tok_dir, out)
    assert not res.skipped and len(IndexedTokenDataset(out)) == 10
    assert any("interrupted prepare" in m for m in logs) and not stale.exists()
    assert any("rebuilding" in m and "no manifest.json" in m for m in logs)


_KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from longboat.llm.data import indexed
    from longboat.llm.data.encoding import load_tokenizer
    from longboat.llm.data.prepare import PrepareOptions, prepare_dataset

    add = indexed.IndexedDatasetWriter.add
    calls = [0]

    def add_then_die(self, *a, **k):
        add(self, *a, **k)
        calls[0] += 1
        if calls[0] == 3:  # mid-write: tokens on disk, no offsets, no manifest
            self._tokens.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    indexed.IndexedDatasetWriter.add = add_then_die
    inp, tok, fresh, existing = map(Path, sys.argv[1:5])

    def run(out):
        opts = PrepareOptions(input=inp, tokenizer=tok, output=out, chunk_size=4, force=True)
        prepare_dataset(opts, progress=False)

    # Loaded before the fork, so the child inherits transformers / torch: one import for both
    # cases (each costs seconds).
    load_tokenizer(tok)
    child = os.fork()  # one interpreter start for both cases
    if child == 0:
        run(fresh)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited", flush=True)
    run(existing)
    """
)


@pytest.mark.multiprocess
def test_killed_prepare_is_never_read_as_finished(tok_dir: Path, tmp_path: Path) -> None:
    inp = _jsonl(tmp_path / "a.jsonl", _texts(40))
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    _prepare(_jsonl(tmp_path / "b.jsonl", _texts(7)), tok_dir, existing)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, str(inp), str(tok_dir), str(fresh), str(existing)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Both builds were SIGKILLed mid-write: the fresh one (child) and the --force rebuild.
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.splitlines()[0] == f"child {int(signal.SIGKILL)}", proc.stdout
    for out in (fresh, existing):
        (tmp,) = tmp_path.glob(f".{out.name}.tmp-*")
        assert (tmp / "tokens.bin").stat().st_size > 0 and not (tmp / "manifest.json").exists()
        with pytest.raises(IncompleteDatasetError):
            IndexedTokenDataset(tmp)
    assert not fresh.exists()  # nothing at the output name
    assert len(IndexedTokenDataset(existing)) == 7  # the previous dataset survives intact
    res, logs = _prepare(inp, tok_dir, fresh)
    assert not res.skipped and len(IndexedTokenDataset(fresh)) == 40
    assert any("interrupted prepare" in m for m in logs)


def test_corrupt_or_truncated_files_fail_naming_the_file(tok_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _prepare(_jsonl(tmp_path / "a.jsonl", _texts(10)), tok_dir, out)
    offsets = (out / "offsets.bin").read_bytes()
    (out / "offsets.bin").write_bytes(offsets[:-3])
    with pytest.raises(ValueError, match=r"offsets\.bin has .* bytes .* truncated or corrupt"):
        IndexedTokenDataset(out)
    bad = np.frombuffer(offsets, dtype=np.int64).copy()
    bad[3], bad[4] = bad[4], bad[3]  # right size, not monotonic
    (out / "offsets.bin").write_bytes(bad.tobytes())
    with pytest.raises(ValueError, match=r"offsets\.bin is corrupt"):
        IndexedTokenDataset(out)
    (out / "offsets.bin").write_bytes(offsets)
    tokens = (out / "tokens.bin").read_bytes()
    (out / "tokens.bin").write_bytes(tokens[:-2])
    with pytest.raises(ValueError, match=r"tokens\.bin has .* bytes"):
        IndexedTokenDataset(out)
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(IncompleteDatasetError, match=r"manifest\.json is not valid JSON"):
        IndexedTokenDataset(out)


def test_bad_inputs_fail_before_work_naming_the_file(tok_dir: Path, tmp_path: Path) -> None:
    good = _jsonl(tmp_path / "a.jsonl", _texts(5))
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match=r"--tokenizer .*nope is not a directory"):
        _prepare(good, tmp_path / "nope", out)
    (tmp_path / "emptytok").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        _prepare(good, tmp_path / "emptytok", out)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl holds no records"):
        _prepare(tmp_path / "empty.jsonl", tok_dir, out)
    with pytest.raises(ValueError, match=r"a\.jsonl:1: record has no key 'body'"):
        _prepare(good, tok_dir, out, text_key="body")
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p\.parquet: no column 'text'"):
        _prepare(tmp_path / "p.parquet", tok_dir, out)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _prepare(tmp_path / "missing.jsonl", tok_dir, out)
    with pytest.raises(ValueError, match=r"a\.jsonl:1: record has no key 'messages'"):
        _prepare(good, tok_dir, out, format="sft")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_cli_prepare_and_inspect(tok_dir: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    inp, out = _jsonl(tmp_path / "a.jsonl", _texts(30)), tmp_path / "out"
    args = ["prepare", "--input", str(inp), "--tokenizer", str(tok_dir), "--output", str(out)]
    assert data_main([*args, "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert data_main([*args, "--no-progress"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert data_main(["inspect", str(out), "--samples", "2"]) == 0
    text = capsys.readouterr().out
    ds = IndexedTokenDataset(out)
    assert "documents    30" in text and f"tokens       {ds.num_tokens:,}" in text
    hist = [line for line in text.splitlines() if line.startswith("[")]
    assert sum(int(line.split(")")[1].split()[0]) for line in hist) == 30
    assert "--- document 0 " in text and _texts(30)[0] in text and _texts(30)[29] in text
    bad = ["prepare", "--input", str(inp), "--tokenizer", str(tmp_path / "x"), "--output", "o"]
    assert data_main(bad) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_null_and_empty_texts_are_skipped_and_counted(tok_dir: Path, tmp_path: Path) -> None:
    pq.write_table(
        pa.table({"text": ["a quick fox", None, "", "a lazy dog"]}), tmp_path / "n.parquet"
    )
    res, _ = _prepare(tmp_path / "n.parquet", tok_dir, tmp_path / "out")
    report = {"records": 4, "docs": 2, "skipped_null": 1, "skipped_empty": 1}
    assert res.manifest["report"] == report
    assert len(IndexedTokenDataset(res.path)) == 2
    with pytest.raises(FileNotFoundError, match="does not exist"):
        IndexedTokenDataset(tmp_path / "nowhere")
