"""Preference pairs read in both forms, validated record by record, and tokenised so that
the two answers follow the same prompt tokens and their masks cover the answers alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longboat.llm.data.encoding import load_tokenizer
from longboat.llm.data.preference import read_preference_pairs
from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

Q = "what is two plus two?"
GOOD, BAD = "it is four", "it is five"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(train_tiny_tokenizer([Q, GOOD, BAD] * 5, tmp_path_factory.mktemp("t")))


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_both_forms_give_the_same_tokens(tok, tmp_path: Path) -> None:
    explicit = {"prompt": Q, "chosen": GOOD, "rejected": BAD}
    user = {"role": "user", "content": Q}
    implicit = {
        "chosen": [user, {"role": "assistant", "content": GOOD}],
        "rejected": [user, {"role": "assistant", "content": BAD}],
    }
    a = read_preference_pairs(_jsonl(tmp_path / "a.jsonl", [explicit]), tok)[0]
    b = read_preference_pairs(_jsonl(tmp_path / "b.jsonl", [implicit]), tok)[0]
    pq.write_table(pa.Table.from_pylist([{"question": Q, "good": GOOD, "bad": BAD}]),
                   tmp_path / "c.parquet")  # fmt: skip
    cols = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    c = read_preference_pairs(tmp_path / "c.parquet", tok, columns=cols)[0]
    for pair in (b, c):
        for key in ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"):
            assert np.array_equal(getattr(pair, key), getattr(a, key)), key
        assert pair.prompt_len == a.prompt_len
    # The same prompt tokens, then each answer (its tokens masked) and the end of turn.
    k = a.prompt_len
    assert np.array_equal(a.chosen_ids[:k], a.rejected_ids[:k])
    assert not a.chosen_mask[:k].any() and a.chosen_mask[k:].all() and a.rejected_mask[k:].all()
    assert tok.decode(a.chosen_ids[k:].tolist()).startswith(GOOD)
    assert tok.decode(a.rejected_ids[k:].tolist()).startswith(BAD)
    assert a.where == f"{tmp_path / 'a.jsonl'}:1"


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": Q, "chosen": GOOD}, r"needs 'chosen' and 'rejected' \(missing \['rejected'\]"),
        ({"prompt": Q, "chosen": GOOD, "rejected": GOOD}, "the same answer: nothing to prefer"),
        ({"prompt": Q, "chosen": " ", "rejected": BAD}, "the chosen answer is empty"),
        ({"prompt": "", "chosen": GOOD, "rejected": BAD}, "the prompt is empty"),
        ({"prompt": Q, "chosen": 4, "rejected": BAD}, "'chosen' must be a string or a list"),
        ({"prompt": Q, "chosen": [{"role": "user", "content": GOOD}], "rejected": BAD},
         "'chosen' must be assistant turns"),
        ({"chosen": [{"role": "user", "content": Q}, {"role": "assistant", "content": GOOD}],
          "rejected": [{"role": "user", "content": "other"},
                       {"role": "assistant", "content": BAD}]},
         "share every turn but the last"),
    ],
)  # fmt: skip
def test_an_invalid_pair_is_named_with_its_line(tok, tmp_path: Path, record, message) -> None:
    good = {"prompt": Q, "chosen": GOOD, "rejected": BAD}
    path = _jsonl(tmp_path / "pairs.jsonl", [good, record])
    with pytest.raises(ValueError, match=rf"pairs\.jsonl:2: .*{message}"):
        read_preference_pairs(path, tok)
