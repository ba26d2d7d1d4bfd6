"""SFT records in the common chat forms give the tokens and loss mask of the same chat as
``messages``: ShareGPT ``conversations``, Alpaca ``instruction`` / ``input`` / ``output``,
``prompt`` / ``completion`` (strings or turn lists), a ``system`` field, other key names
through ``data.columns``; JSONL, Parquet and a ``datasets`` folder alike. A record in no form
is named with its file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longboat.llm.data import IndexedTokenDataset
from longboat.llm.data.raw import detect_format, prepared_path
from longboat.llm.data.sources import resolve_input
from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

SYSTEM = "you answer briefly"


def _chat(i: int, *, system: bool = False, extra: bool = False) -> list[dict[str, str]]:
    user = f"what is {i} plus one?" + ("\n\nshow your work" if extra else "")
    turns = [{"role": "user", "content": user}, {"role": "assistant", "content": f"it is {i + 1}"}]
    return ([{"role": "system", "content": SYSTEM}] if system else []) + turns


def _forms(i: int) -> dict[str, tuple[dict, list[dict[str, str]]]]:
    """form name -> (record, the messages it means)."""
    q, a = f"what is {i} plus one?", f"it is {i + 1}"
    return {
        "messages": ({"messages": _chat(i)}, _chat(i)),
        "sharegpt": (
            {
                "conversations": [
                    {"from": "system", "value": SYSTEM},
                    {"from": "human", "value": q},
                    {"from": "gpt", "value": a},
                ]
            },
            _chat(i, system=True),
        ),
        "alpaca": ({"instruction": q, "input": "", "output": a}, _chat(i)),
        "alpaca_input": (
            {"instruction": q, "input": "show your work", "output": a, "system": SYSTEM},
            _chat(i, system=True, extra=True),
        ),
        "prompt_completion": ({"prompt": q, "completion": a}, _chat(i)),
        "prompt_turns": (
            {
                "prompt": [{"role": "user", "content": q}],
                "completion": [{"role": "assistant", "content": a}],
            },
            _chat(i),
        ),
    }


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = [m["content"] for i in range(12) for m in _chat(i, system=True, extra=True)]
    return train_tiny_tokenizer(corpus, tmp_path_factory.mktemp("tok") / "tok")


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _tokens(path: Path, tok_dir: Path, cache: Path, **kw) -> list[tuple[list[int], list[int]]]:
    ds = IndexedTokenDataset(prepared_path(path, tok_dir, cache_dir=cache, log=lambda *_: None,
                                           progress=False, **kw))  # fmt: skip
    assert ds.manifest["kind"] == "sft"
    return [(ds[i].tolist(), ds.loss_mask(i).tolist()) for i in range(len(ds))]


def test_every_form_gives_the_tokens_and_mask_of_its_messages(tok_dir, tmp_path) -> None:
    n = 6
    for form in _forms(0):
        records = [_forms(i)[form][0] for i in range(n)]
        want = [{"messages": _forms(i)[form][1]} for i in range(n)]
        got_file = _jsonl(tmp_path / f"{form}.jsonl", records)
        assert detect_format(resolve_input(got_file)) == "sft", form
        ref_file = _jsonl(tmp_path / f"{form}_ref.jsonl", want)
        got = _tokens(got_file, tok_dir, tmp_path / "cache")
        ref = _tokens(ref_file, tok_dir, tmp_path / "cache")
        assert got == ref, form
        assert all(any(m) for _, m in got), "the loss covers the answers"


def test_parquet_and_datasets_folders_read_the_same_forms(tok_dir, tmp_path) -> None:
    records = [_forms(i)["alpaca_input"][0] for i in range(5)]
    ref = _tokens(_jsonl(tmp_path / "a.jsonl", records), tok_dir, tmp_path / "cache")
    table = pa.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "a.parquet")
    assert _tokens(tmp_path / "a.parquet", tok_dir, tmp_path / "cache") == ref
    folder = tmp_path / "saved"  # what datasets' save_to_disk writes
    folder.mkdir()
    arrow = str(folder / "data-00000-of-00001.arrow")
    with pa.OSFile(arrow, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (folder / "state.json").write_text("{}")
    assert _tokens(folder, tok_dir, tmp_path / "cache") == ref


def test_other_key_names_are_read_through_data_columns(tok_dir, tmp_path) -> None:
    records = [{"question": f"what is {i} plus one?", "answer": f"it is {i + 1}"} for i in range(4)]
    mine = _jsonl(tmp_path / "qa.jsonl", records)
    columns = {"prompt": "question", "completion": "answer"}
    assert detect_format(resolve_input(mine)) == "pretrain"
    assert detect_format(resolve_input(mine), columns) == "sft"
    ref = _jsonl(tmp_path / "ref.jsonl", [{"messages": _chat(i)} for i in range(4)])
    got = _tokens(mine, tok_dir, tmp_path / "cache", columns=columns)
    assert got == _tokens(ref, tok_dir, tmp_path / "cache")


def test_a_record_in_no_chat_form_is_named(tok_dir, tmp_path) -> None:
    records = [_forms(0)["sharegpt"][0], {"question": "hi", "answer": "ho"}]
    bad = _jsonl(tmp_path / "mixed.jsonl", records)
    with pytest.raises(ValueError, match=r"mixed\.jsonl:2: record has no key 'messages' nor "
                       r"another chat form \(keys: \['answer', 'question'\]\)"):  # fmt: skip
        prepared_path(bad, tok_dir, cache_dir=tmp_path / "cache", format="sft", progress=False,
                      log=lambda *_: None)  # fmt: skip
    turns = [{"conversations": [{"from": "narrator", "value": "x"}]}]
    with pytest.raises(ValueError, match=r"odd\.jsonl:1: conversations\[0\] must have a role"):
        prepared_path(_jsonl(tmp_path / "odd.jsonl", turns), tok_dir, cache_dir=tmp_path / "c",
                      format="sft", progress=False, log=lambda *_: None)  # fmt: skip


def test_unknown_data_columns_are_refused_at_compose_time(tmp_path) -> None:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        compose_experiment("quickstart", ["data=prepared", "+data.columns={answer: reply}"],
                           stack="llm", world_size=1)  # fmt: skip
    assert "data.columns" in err.value.keys and "not keys longboat reads" in str(err.value)
    np.testing.assert_equal(len(err.value.keys), len(set(err.value.keys)))


def test_the_readmes_records_read_as_they_mean(tmp_path) -> None:
    import re

    from longboat.llm.data.sft_records import to_messages

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Data formats", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| ([^|`]+?) \| `(\{.*?\})`", section, flags=re.M))
    assert set(rows) == {"pretraining text", "chat messages", "ShareGPT", "Alpaca",
                         "prompt / completion"}  # fmt: skip
    hi = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    for form, text in rows.items():
        path = _jsonl(tmp_path / "r.jsonl", [json.loads(text)])
        kind = detect_format(resolve_input(path))
        assert kind == ("pretrain" if form == "pretraining text" else "sft"), form
        if form in ("chat messages", "ShareGPT", "prompt / completion"):
            assert to_messages(json.loads(text), form) == hi, form
    alpaca = to_messages(json.loads(rows["Alpaca"]), "Alpaca")
    assert alpaca == [{"role": "user", "content": "Add 2 and 3."},
                      {"role": "assistant", "content": "5"}]  # fmt: skip
