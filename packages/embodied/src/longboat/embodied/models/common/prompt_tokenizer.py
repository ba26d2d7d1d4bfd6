"""A Hugging Face tokenizer that turns prompts into fixed-length ids as LeRobot's tokenizer
step does (right padding, cut at ``max_length``); the policies' prompt tokenizers (pi0.5,
SmolVLA) build on it with their own prompt text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from longboat.core.config.errors import ConfigError


class FixedLengthTokenizer:
    """``transformers.AutoTokenizer`` of ``path`` padding / cutting prompts to
    ``max_length`` ids; a ConfigError (key ``model.tokenizer``) when it cannot be loaded."""

    def __init__(self, path: str | Path, max_length: int) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ConfigError(
                "needs the transformers package to read a Hugging Face tokenizer",
                key="model.tokenizer",
                value=str(path),
                fix="pip install 'transformers>=5'",
            ) from err
        self.path = Path(path)
        self.max_length = int(max_length)
        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(str(path))
        except Exception as err:  # transformers raises many error types for a bad directory
            raise ConfigError(
                f"could not be loaded by transformers.AutoTokenizer ({err})",
                key="model.tokenizer",
                value=str(path),
            ) from err

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can emit (added tokens included)."""
        return len(self.tokenizer)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> (input_ids int64 [B, max_length], attention_mask bool [B, max_length]),
        padded on the right."""
        out = self.tokenizer(
            prompts,
            max_length=self.max_length,
            truncation=True,
            padding="max_length",
            padding_side="right",
            return_tensors="pt",
        )
        return out["input_ids"].to(torch.int64), out["attention_mask"].to(torch.bool)


def check_vocab(tokenizer: FixedLengthTokenizer, path: Path, vocab_size: int, fix: str) -> None:
    """A ConfigError (naming ``fix``) when ``tokenizer`` emits ids past the model's
    ``vocab_size``."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"has {tokenizer.vocab_size} ids, more than the model's vocabulary of {vocab_size}",
            key="model.tokenizer",
            value=str(path),
            fix=fix,
        )
