"""Tiny datasets and configs for tests of ``longboat-llm train`` (CPU, seconds)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TINY_MODEL = [
    "model.vocab_size=256",
    "model.hidden_size=64",
    "model.num_layers=4",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.head_dim=16",
    "model.ffn_hidden_size=128",
    "model.max_position_embeddings=64",
]


def make_tiny_dataset(root: Path, *, docs: int = 120) -> tuple[Path, Path]:
    """(prepared dataset dir, tokenizer dir) of short synthetic sentences, vocab <= 256."""
    from longboat.llm.data.prepare import PrepareOptions, prepare_dataset
    from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

    words = ["boat", "sail", "wind", "oar", "sea", "tide", "row", "mast", "deck", "crew"]
    texts = [
        " ".join(words[(i * 7 + j * (i % 5 + 1)) % len(words)] for j in range(5 + i % 23))
        for i in range(docs)
    ]
    root.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_tokenizer(texts, root / "tokenizer", vocab_size=256)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    opts = PrepareOptions(input=corpus, tokenizer=Path(tok), output=root / "tokens")
    prepare_dataset(opts, log=lambda *_: None, progress=False)
    return root / "tokens", Path(tok)


def make_tiny_sft_dataset(root: Path, *, records: int = 80) -> tuple[Path, Path]:
    """(SFT dataset dir, tokenizer dir): short chats whose answers follow from the question."""
    from longboat.llm.data.prepare import PrepareOptions, prepare_dataset
    from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

    chats = [
        [
            {"role": "user", "content": f"count from {i % 7} please"},
            {"role": "assistant", "content": " ".join(str((i % 7) + k) for k in range(4))},
        ]
        for i in range(records)
    ]
    root.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_tokenizer(
        [m["content"] for c in chats for m in c], root / "tokenizer", vocab_size=256
    )
    corpus = root / "chats.jsonl"
    corpus.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    opts = PrepareOptions(input=corpus, tokenizer=Path(tok), output=root / "sft", format="sft")
    prepare_dataset(opts, log=lambda *_: None, progress=False)
    return root / "sft", Path(tok)


def tiny_overrides(data_dir: Path, tokenizer: Path, out: Path, *, steps: int = 10) -> list[str]:
    """Overrides of the ``quickstart`` experiment: the tiny model on a prepared dataset."""
    return [
        *TINY_MODEL,
        "data=prepared",
        f"data.paths=[{data_dir}]",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=32",
        "data.eval_fraction=0.1",
        f"train.steps={steps}",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.eval_every=0",
        "train.log_every=1",
        "optim.lr=0.01",
        "optim.schedule.warmup_steps=2",
        f"checkpoint.dir={out}/ckpt",
        "checkpoint.every_steps=0",
        "checkpoint.save_on_exit=false",
        "checkpoint.resume=none",
        f"logging.dir={out}/logs",
        "logging.progress=false",
        "logging.tensorboard=false",
        "llm.export_hf=false",
        "llm.generate_prompt=null",
        "llm.eval_batches=1",
    ]


def compose(overrides: Sequence[str], *, world_size: int | None = None) -> Any:
    """The composed, validated ``quickstart`` experiment with ``overrides``."""
    from longboat.core.config.compose import compose_experiment

    return compose_experiment("quickstart", list(overrides), stack="llm", world_size=world_size)
