"""``longboat-vlm data prepare`` and the encoded-sample cache (CPU, the generated shapes set).

Prepare writes a cache entry; the next run's data reuse it (its note says so) and give rows
equal to encoding without a cache, key by key; another option misses; an interrupted build
leaves nothing a later run would read; a bad data path exits 2 naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from longboat.vlm.data.cli import data_main


def _overrides(tmp: Path, *extra: str) -> list[str]:
    return [
        f"data.out_dir={tmp / 'data'}",
        "data.num_train=16",
        "data.num_eval=4",
        "data.seq_len=256",
        f"data.cache_dir={tmp / 'cache'}",
        *extra,
    ]


def _run_data(overrides: list[str]) -> Any:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import typed_config
    from longboat.vlm.train.data import open_run_data
    from longboat.vlm.train.training import model_config

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="vlm"))
    return open_run_data(cfg, model_config(cfg))


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def _assert_rows_equal(a: Any, b: Any) -> None:
    assert len(a) == len(b) and len(a) > 0
    for i in range(len(a)):
        ra, rb = a[i], b[i]
        assert ra.keys() == rb.keys()
        for key, va in ra.items():
            vb = rb[key]
            if isinstance(va, torch.Tensor):
                assert va.dtype == vb.dtype and torch.equal(va, vb), (i, key)
            else:
                assert va == vb, (i, key)


def test_prepare_then_train_reuses_the_cache(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = data_main(["prepare", "experiment=quickstart", *_overrides(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("encoded into cache") == 2  # the train and the held-out files
    assert "packed rows of 256" in out
    entries = _entries(tmp_path / "cache")
    assert len(entries) == 2 and not [e for e in entries if e.startswith(".")]

    cached = _run_data(_overrides(tmp_path))
    reused = [n for n in cached.notes if n.startswith("Data: reused cache")]
    assert len(reused) == 2, cached.notes
    plain = _run_data([o for o in _overrides(tmp_path) if not o.startswith("data.cache_dir")])
    assert not [n for n in plain.notes if "cache" in n]
    _assert_rows_equal(cached.train, plain.train)
    _assert_rows_equal(cached.eval, plain.eval)
    assert cached.train.plan_fingerprint() == plain.train.plan_fingerprint()

    other = _run_data(_overrides(tmp_path, "data.seq_len=320"))  # another option: a miss
    assert sum(n.startswith("Data: encoded into cache") for n in other.notes) == 2
    assert len(_entries(tmp_path / "cache")) == 4


def test_an_interrupted_build_leaves_no_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from longboat.vlm.data import cache

    def interrupted(out: Path, samples: list[Any]) -> None:
        (out / "input_ids.npy").write_bytes(b"half")
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(cache, "_write", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _run_data(_overrides(tmp_path))
    assert _entries(tmp_path / "cache") == []  # no entry, no temp dir
    again = _run_data(_overrides(tmp_path))
    assert sum(n.startswith("Data: encoded into cache") for n in again.notes) == 2


def test_prepare_with_a_bad_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from longboat.vlm.data.shapes_dataset import build_shapes_tokenizer

    tok = build_shapes_tokenizer(tmp_path / "tok").path
    missing = tmp_path / "none.jsonl"
    args = [
        "prepare",
        "experiment=sft",
        f"data.paths=[{missing}]",
        f"data.tokenizer={tok}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "--no-progress",
    ]
    assert data_main(args) == 2
    err = capsys.readouterr().err
    assert "none.jsonl" in err and "Traceback" not in err
    assert data_main(["prepare", "experiment=quickstart", "--no-progress"]) == 2
    assert "data.cache_dir" in capsys.readouterr().err
