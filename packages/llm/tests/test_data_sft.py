"""SFT data: chat rendering, assistant-only loss mask, overflow report, packing of SFT docs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from longboat.core.data.packing import IGNORE_INDEX, PackedDataset
from longboat.llm.data import IndexedTokenDataset
from longboat.llm.data.encoding import load_tokenizer, render_sft
from longboat.llm.data.inspection import inspect_dataset
from longboat.llm.data.prepare import PrepareOptions, prepare_dataset
from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

EOT = "<|eot|>"


def _conversation(i: int) -> list[dict[str, str]]:
    turns = [
        {"role": "system", "content": "you answer briefly"},
        {"role": "user", "content": f"what is {i} plus one?"},
        {"role": "assistant", "content": f"it is {i + 1}"},
    ]
    if i % 2:
        turns += [
            {"role": "user", "content": "and the quick fox?"},
            {"role": "assistant", "content": "jumps over the lazy dog " * (1 + i % 5)},
        ]
    return turns


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = [m["content"] for i in range(12) for m in _conversation(i)]
    return train_tiny_tokenizer(corpus, tmp_path_factory.mktemp("tok") / "tok")


def _write(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"messages": _conversation(i)}) + "\n" for i in range(n)))
    return path


def _assistant_text(conv: list[dict[str, str]]) -> str:
    return "".join(m["content"] + EOT for m in conv if m["role"] == "assistant")


def test_mask_is_exactly_the_assistant_turns(tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir)
    for i in range(6):
        conv = _conversation(i)
        ids, mask = render_sft(tok, conv)
        assert tok.decode(ids.tolist()) == tok.apply_chat_template(conv, tokenize=False)
        # Masked tokens decode to exactly the assistant contents (+ their end-of-turn token);
        # the unmasked ones hold every system/user word and the role headers.
        assert tok.decode(ids[mask == 1].tolist()) == _assistant_text(conv)
        rest = tok.decode(ids[mask == 0].tolist())
        for m in conv:
            if m["role"] != "assistant":
                assert m["content"] in rest
        assert "<|assistant|>" in rest and "<|user|>" in rest


def test_prepare_sft_truncate_and_drop_report(tok_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(tok_dir)
    inp = _write(tmp_path / "chat.jsonl", 12)
    full_lens = [len(render_sft(tok, _conversation(i))[0]) for i in range(12)]
    limit = sorted(full_lens)[6]
    over = sum(n > limit for n in full_lens)
    assert 0 < over < 12

    def build(overflow: str, out: str) -> IndexedTokenDataset:
        opts = PrepareOptions(
            input=inp,
            tokenizer=tok_dir,
            output=tmp_path / out,
            format="sft",
            max_seq_len=limit,
            sft_overflow=overflow,  # type: ignore[arg-type]
        )
        return IndexedTokenDataset(prepare_dataset(opts, progress=False, log=lambda m: None).path)

    dropped = build("drop", "drop")
    rep = dropped.manifest["report"]
    assert rep["dropped_overflow"] == over and rep["truncated"] == 0 and len(dropped) == 12 - over
    assert dropped.has_loss_mask and dropped.manifest["kind"] == "sft"
    kept = [i for i in range(12) if full_lens[i] <= limit]
    for doc, i in enumerate(kept):
        assert tok.decode(dropped[doc][dropped.loss_mask(doc) == 1].tolist()) == _assistant_text(
            _conversation(i)
        )
    truncated = build("truncate", "trunc")
    rep = truncated.manifest["report"]
    assert rep["truncated"] == over and rep["dropped_overflow"] == 0 and len(truncated) == 12
    assert truncated.lengths().max() == limit
    np.testing.assert_array_equal(truncated.lengths(), np.minimum(full_lens, limit))


def test_packed_sft_labels_only_on_assistant_tokens(tok_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(tok_dir)
    out = tmp_path / "sft"
    opts = PrepareOptions(
        input=_write(tmp_path / "c.jsonl", 9), tokenizer=tok_dir, output=out, format="sft"
    )
    ds = IndexedTokenDataset(prepare_dataset(opts, progress=False, log=lambda m: None).path)
    n_loss = sum(int(ds.loss_mask(i).sum()) for i in range(len(ds)))
    assert ds.num_loss_tokens == n_loss
    assert f"loss tokens  {n_loss:,} " in inspect_dataset(out, samples=1)
    packed = PackedDataset(ds.documents(), 96, pad_id=tok.pad_token_id)
    assert len(packed) < len(ds)
    targets = np.concatenate([r["labels"][r["labels"] != IGNORE_INDEX] for r in packed])
    # Labels are the next tokens that the mask marks, no more no less (one mask token per
    # document is a first token, which is never a target).
    expected = sum(int(ds.loss_mask(i)[1:].sum()) for i in range(len(ds)))
    assert len(targets) == expected
    assert sorted(tok.decode(targets.tolist()).split(EOT)) == sorted(
        "".join(_assistant_text(_conversation(i)) for i in range(9)).split(EOT)
    )


def test_sft_from_parquet_matches_jsonl(tok_dir: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    convs = [_conversation(i) for i in range(5)]
    pq.write_table(pa.table({"messages": convs}), tmp_path / "c.parquet")
    built = []
    for name, inp in (("pq", tmp_path / "c.parquet"), ("js", _write(tmp_path / "c.jsonl", 5))):
        opts = PrepareOptions(input=inp, tokenizer=tok_dir, output=tmp_path / name, format="sft")
        built.append(IndexedTokenDataset(prepare_dataset(opts, progress=False, log=print).path))
    a, b = built
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    np.testing.assert_array_equal(a.loss_mask(3), b.loss_mask(3))
