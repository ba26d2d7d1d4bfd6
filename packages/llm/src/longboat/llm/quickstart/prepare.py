"""Build the quickstart dataset once: corpus -> BPE tokenizer -> ``data prepare``.

``out_dir`` ends up holding ``corpus.jsonl`` (one text block per line), ``tokenizer/`` (a
byte-level BPE trained in seconds, a transformers tokenizer directory) and ``tokens/`` (the
indexed token dataset ``longboat-llm data prepare`` writes). Corpus and tokenizer are
written to temporary names and renamed, and ``data prepare`` swaps its output into place,
so a killed run never leaves a half-built part that looks finished; a second run reuses
all three.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from longboat.llm.quickstart.corpus import build_corpus

META = "quickstart.json"


def _build_text_and_tokenizer(out: Path, vocab_size: int, max_chars: int) -> None:
    from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

    docs = build_corpus(max_chars)
    if not docs:
        raise FileNotFoundError(
            "the quickstart found no text in the installed longboat packages; reinstall "
            "longboat-llm (its wheel ships its sources)"
        )
    tmp = out / "corpus.jsonl.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    tmp.rename(out / "corpus.jsonl")
    tok_tmp = out / "tokenizer.tmp"
    shutil.rmtree(tok_tmp, ignore_errors=True)
    train_tiny_tokenizer(docs, tok_tmp, vocab_size=vocab_size)
    shutil.rmtree(out / "tokenizer", ignore_errors=True)
    tok_tmp.rename(out / "tokenizer")


def prepare_quickstart(cfg: Any, *, log: Any = print) -> tuple[Path, Path]:
    """(token dataset dir, tokenizer dir) for a ``QuickstartDataConfig``, built if missing."""
    from longboat.llm.data.prepare import PrepareOptions, prepare_dataset

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wanted = {"vocab_size": int(cfg.vocab_size), "max_chars": int(cfg.max_chars)}
    meta = out / META
    have = json.loads(meta.read_text()) if meta.is_file() else None
    rebuilt = have != wanted or not (out / "tokenizer" / "tokenizer.json").is_file()
    if rebuilt:
        meta.unlink(missing_ok=True)
        log(f"Building the quickstart corpus and a {wanted['vocab_size']}-token BPE in {out}")
        _build_text_and_tokenizer(out, wanted["vocab_size"], wanted["max_chars"])
        meta.write_text(json.dumps(wanted))

    def prepare(force: bool) -> None:
        opts = PrepareOptions(
            input=out / "corpus.jsonl",
            tokenizer=out / "tokenizer",
            output=out / "tokens",
            force=force,
            workers=2,
        )
        prepare_dataset(opts, log=log, progress=False)

    try:
        prepare(rebuilt)
    except FileExistsError:  # tokens of another corpus/tokenizer (e.g. a moved folder)
        prepare(True)
    return out / "tokens", out / "tokenizer"
