"""Bad inputs fail before training, with an error naming the file or key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from llm_testkit import compose, make_tiny_dataset, tiny_overrides

from longboat.core.config.errors import ConfigError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    data, tok = make_tiny_dataset(root / "data")
    return data, tok, root


class _Reached(Exception):
    """Raised where megatron's parallel state would be set up: the checks let the run in."""


def _run(overrides: list[str]) -> list[int]:
    """Start ``longboat-llm train`` with ``overrides``, stopping where the heavy setup would
    begin (megatron's parallel state, then the model); returns [1] when it got there, []
    when a check stopped it first."""
    from longboat.core.megatron import parallel_state
    from longboat.llm.train import training

    calls: list[int] = []
    real = parallel_state.initialize

    def reached(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise _Reached

    parallel_state.initialize = reached  # type: ignore[assignment]
    try:
        training.train(compose(overrides))
    except _Reached:
        pass
    finally:
        parallel_state.initialize = real  # type: ignore[assignment]
    return calls


def _expect(overrides: list[str], *needles: str) -> str:
    with pytest.raises(ConfigError) as err:
        assert not _run(overrides), "training started"
    text = str(err.value)
    for needle in needles:
        assert needle in text, f"{needle!r} not in: {text}"
    return text


def test_valid_inputs_reach_training(tiny: tuple[Path, Path, Path], tmp_path: Path) -> None:
    data, tok, _ = tiny
    # The control: the checks below are what stops the others.
    assert _run(tiny_overrides(data, tok, tmp_path)) == [1]


def test_missing_tokenizer_dir(tiny: tuple[Path, Path, Path], tmp_path: Path) -> None:
    data, tok, _ = tiny
    missing = tmp_path / "no_tokenizer"
    _expect(
        [*tiny_overrides(data, tok, tmp_path), f"data.tokenizer={missing}"],
        "data.tokenizer",
        str(missing),
    )


def test_empty_dataset(tiny: tuple[Path, Path, Path], tmp_path: Path) -> None:
    data, tok, _ = tiny
    empty = tmp_path / "empty"
    shutil.copytree(data, empty)
    manifest = json.loads((empty / "manifest.json").read_text())
    manifest.update(num_docs=0, num_tokens=0)
    (empty / "manifest.json").write_text(json.dumps(manifest))
    np.zeros(1, dtype=np.int64).tofile(empty / "offsets.bin")
    (empty / "tokens.bin").write_bytes(b"")
    _expect([*tiny_overrides(empty, tok, tmp_path)], "data.paths", str(empty), "empty")


def test_corrupt_index(tiny: tuple[Path, Path, Path], tmp_path: Path) -> None:
    data, tok, _ = tiny
    bad = tmp_path / "corrupt"
    shutil.copytree(data, bad)
    offsets = np.fromfile(bad / "offsets.bin", dtype=np.int64)
    offsets[len(offsets) // 2] = -5  # same size, offsets no longer rise
    offsets.tofile(bad / "offsets.bin")
    _expect([*tiny_overrides(bad, tok, tmp_path)], "data.paths", "offsets.bin", "corrupt")


def test_truncated_tokens_file(tiny: tuple[Path, Path, Path], tmp_path: Path) -> None:
    data, tok, _ = tiny
    bad = tmp_path / "truncated"
    shutil.copytree(data, bad)
    raw = (bad / "tokens.bin").read_bytes()
    (bad / "tokens.bin").write_bytes(raw[: len(raw) // 2])
    _expect([*tiny_overrides(bad, tok, tmp_path)], "tokens.bin", "truncated")


def test_seq_len_above_model_max(tiny: tuple[Path, Path, Path], tmp_path: Path) -> None:
    data, tok, _ = tiny
    _expect(
        [*tiny_overrides(data, tok, tmp_path), "data.seq_len=65"],
        "data.seq_len",
        "model.max_position_embeddings=64",
    )


def test_token_ids_outside_vocab(tiny: tuple[Path, Path, Path], tmp_path: Path) -> None:
    data, tok, _ = tiny
    _expect([*tiny_overrides(data, tok, tmp_path), "model.vocab_size=64"], "model.vocab_size")


def test_cli_reports_the_error_without_traceback(
    tiny: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from longboat.llm.cli import main

    data, tok, _ = tiny
    code = main(
        ["train", "experiment=quickstart", *tiny_overrides(data, tok, tmp_path), "data.seq_len=65"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "data.seq_len" in err and "Traceback" not in err
