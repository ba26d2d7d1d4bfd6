"""LLM run checks that need the model and data sections together; run before heavy init."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError, ProblemCollector
from longboat.core.megatron.decoder_config import DecoderModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_run(cfg: Any, model: DecoderModelConfig, *, world_size: int | None = None) -> None:
    """Cross-section checks: sequence length, vocabulary, tokenizer, data paths, init dir,
    LoRA and (``world_size``) the parallel layout; one ``ConfigError`` listing every problem,
    before any data is read."""
    p = ProblemCollector()
    data = cfg.data
    seq_len = data.seq_len
    if seq_len > model.max_position_embeddings:
        p.add(
            "data.seq_len",
            f"is above the model's maximum sequence length "
            f"model.max_position_embeddings={model.max_position_embeddings}",
            value=seq_len,
            fix=f"use data.seq_len<={model.max_position_embeddings} or raise "
            "model.max_position_embeddings",
        )
    if seq_len < 2:
        p.add("data.seq_len", "must be >= 2", value=seq_len)
    if data.name == "quickstart" and data.vocab_size > model.vocab_size:
        p.add(
            "data.vocab_size",
            f"is larger than model.vocab_size={model.vocab_size}",
            value=data.vocab_size,
            fix=f"set model.vocab_size>={data.vocab_size}",
        )
    if data.name == "prepared":
        _collect(p, check_tokenizer_dir, data.tokenizer)
        if not data.paths:
            p.add(
                "data.paths",
                "no data given",
                value=[],
                fix="data.paths=[chats.jsonl, ...]: JSONL / JSON / Parquet / .txt files or "
                "folders of them, datasets folders, or datasets `longboat-llm data prepare` wrote",
            )
        if data.weights is not None and len(data.weights) != len(data.paths):
            p.add(
                "data.weights",
                f"has {len(data.weights)} weights for {len(data.paths)} paths",
                value=list(data.weights),
                fix="give one weight per data.paths entry, or null",
            )
    if world_size is not None:
        from longboat.core.config.validate import check_parallel

        _collect(p, check_parallel, cfg.parallel, world_size)
    init = cfg.model.init_from
    if _collect(p, _require_file, init, "config.json", "model.init_from",
                "point at a Hugging Face model directory, or null for random init") and init:  # fmt: skip
        from longboat.llm.hf_checkpoint import check_matches_flavor, read_hf_config

        _collect(p, lambda: check_matches_flavor(model, read_hf_config(init),
                                                 f"{init}/config.json"))  # fmt: skip
    export = cfg.export.dir or f"{cfg.output_dir}/hf"
    if init is not None and cfg.export.enabled and Path(export).resolve() == Path(init).resolve():
        p.add(
            "export.dir",
            "is the checkpoint the run starts from: exporting would overwrite its weights",
            value=export,
            fix="choose another export.dir (null: <output_dir>/hf)",
        )
    if cfg.lora.enabled and cfg.lora.rank < 1:
        p.add("lora.rank", "must be >= 1", value=cfg.lora.rank)
    start = cfg.lora.init_from
    _collect(p, _require_file, start, "adapter_config.json", "lora.init_from",
             "point at a PEFT adapter directory, or null to start the adapters fresh")  # fmt: skip
    if start is not None and not cfg.lora.enabled:
        p.add("lora.init_from", "is set but lora.enabled=false", value=start,
              fix="set lora.enabled=true to continue training the adapter")  # fmt: skip
    p.raise_if_any()


def _collect(p: ProblemCollector, check: Any, *args: Any) -> bool:
    """Run ``check(*args)``; its ``ConfigError`` joins ``p``. True when it passed."""
    try:
        check(*args)
    except ConfigError as exc:
        p.extend(exc)
        return False
    return True


def _require_file(folder: str | None, name: str, key: str, fix: str) -> None:
    """``folder/name`` exists when ``folder`` (the value of ``key``) is set."""
    if folder is not None and not (Path(folder) / name).is_file():
        raise ConfigError(f"{Path(folder) / name} not found", key=key, value=folder, fix=fix)


def check_tokenizer_dir(path: str | None) -> Path:
    """The tokenizer directory, or ``ConfigError`` naming ``data.tokenizer``."""
    if path is None:
        raise ConfigError(
            "no tokenizer given",
            key="data.tokenizer",
            value=None,
            fix="set data.tokenizer to a Hugging Face tokenizer directory",
        )
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(
            f"tokenizer directory {p} does not exist",
            key="data.tokenizer",
            value=str(path),
            fix="point data.tokenizer at a Hugging Face tokenizer directory",
        )
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"{p} holds none of {', '.join(TOKENIZER_FILES)}",
            key="data.tokenizer",
            value=str(path),
            fix="save the tokenizer there with tokenizer.save_pretrained(dir)",
        )
    return p


def check_documents(docs: Any, key: str, where: str, vocab_size: int) -> None:
    """A non-empty document set whose token ids fit the model's vocabulary."""
    import numpy as np

    lengths = np.asarray(docs.lengths())
    if len(lengths) == 0 or int(lengths.sum()) == 0:
        raise ConfigError(
            f"{where}: the dataset is empty (no tokens)",
            key=key,
            value=where,
            fix="prepare it from non-empty input",
        )
    # SFT documents wrap the dataset (``.ds``); pretrain documents are the dataset.
    tokens = getattr(docs, "tokens", None)
    if tokens is None:
        tokens = getattr(getattr(docs, "ds", None), "tokens", None)
    if tokens is not None and len(tokens):
        top = int(np.max(tokens))
        if top >= vocab_size:
            raise ConfigError(
                f"{where}: token id {top} is outside the model's vocabulary",
                key="model.vocab_size",
                value=vocab_size,
                fix=f"use model.vocab_size>={top + 1} or the tokenizer the data was prepared with",
            )
