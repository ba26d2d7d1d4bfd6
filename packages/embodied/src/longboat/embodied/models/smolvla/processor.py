"""SmolVLA's prompt as LeRobot 0.6.1's SmolVLA preprocessor builds it, tokenised with the
backbone's Hugging Face tokenizer (SmolVLM2's for released checkpoints).

The prompt of one sample is its task with a newline appended (unless it ends with one),
tokenised by ``tokenizer(prompts, max_length=L, truncation=True, padding=...,
padding_side="right")`` with ``L`` = LeRobot's ``tokenizer_max_length``. LeRobot pads to
the longest prompt of the batch; longboat pads to ``L`` (fixed shapes): right padding is
masked and moves no position, so the policy's outputs are the same. The state is not in
the prompt (it is one projected prefix token).

Where the tokenizer comes from: ``model.tokenizer=<dir>``; else the ``tokenizer/`` folder of
``model.init_from``, that directory itself, or the local SmolVLM2 directory its
``config.json`` names (``vlm_model_name``, what LeRobot's tokenizer step loads). A run from a
LeRobot checkpoint without one is a ConfigError naming ``model.tokenizer``; from-scratch runs
fall back to the byte-level stand-in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from longboat.core.config.errors import ConfigError
from longboat.embodied.models.common.prompt_tokenizer import FixedLengthTokenizer, check_vocab
from longboat.embodied.models.smolvla.config import SMOLVLM2_500M

TOKENIZER_DIR = "tokenizer"
"""Sub-folder of an exported policy holding its tokenizer files."""


def has_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` holds a Hugging Face tokenizer (tokenizer.json or its config)."""
    d = Path(directory)
    return (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()


def _named_backbone(init_from: Path) -> Path | None:
    """The local backbone directory ``vlm_model_name`` of a LeRobot config names, if any."""
    path = init_from / "config.json"
    try:
        name = json.loads(path.read_text()).get("vlm_model_name") if path.is_file() else None
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    if not name:
        return None
    candidate = Path(name) if Path(name).is_absolute() else init_from / name
    return candidate if has_tokenizer(candidate) else None


def find_tokenizer(tokenizer: str | None, init_from: str | None) -> Path | None:
    """The tokenizer directory of a SmolVLA run (module doc), or None."""
    if tokenizer:
        path = Path(tokenizer)
        if not path.is_dir() or not has_tokenizer(path):
            raise ConfigError(
                "is not a Hugging Face tokenizer directory (no tokenizer.json or "
                "tokenizer_config.json in it)",
                key="model.tokenizer",
                value=tokenizer,
                fix=f"point it at a saved tokenizer, e.g. the files of {SMOLVLM2_500M} "
                f"(hf download {SMOLVLM2_500M} --include 'tokenizer*' --local-dir DIR)",
            )
        return path
    if not init_from or not Path(init_from).is_dir():
        return None
    root = Path(init_from)
    for candidate in (root / TOKENIZER_DIR, root):
        if has_tokenizer(candidate):
            return candidate
    return _named_backbone(root)


def needs_tokenizer(init_from: str | None) -> bool:
    """A run from a LeRobot SmolVLA checkpoint (its text model reads SmolVLM2's ids)."""
    return bool(init_from)


def missing_tokenizer_error(init_from: str) -> ConfigError:
    """The error of a pretrained SmolVLA run without a tokenizer."""
    return ConfigError(
        f"a pretrained SmolVLA (model.init_from={init_from}) reads prompts tokenised by its "
        "backbone's tokenizer, and none was given or found through that directory",
        key="model.tokenizer",
        value=None,
        fix=f"set model.tokenizer=<dir> to the files of {SMOLVLM2_500M} "
        f"(hf download {SMOLVLM2_500M} --include 'tokenizer*' --local-dir DIR)",
    )


def smolvla_prompt(task: str) -> str:
    """The task with the trailing newline LeRobot's preprocessor adds."""
    return task if task.endswith("\n") else f"{task}\n"


class PromptTokenizer(FixedLengthTokenizer):
    """SmolVLA prompts (``smolvla_prompt``) tokenised to ``max_length`` ids as LeRobot does."""

    def __call__(
        self, tasks: Sequence[str], states: Sequence[torch.Tensor], **layout: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tasks -> (input_ids int64 [B, L], attention_mask bool [B, L]); the states and
        ``layout`` are read past (the prompt holds neither the state nor image tokens)."""
        del states, layout
        return self.tokenize([smolvla_prompt(t) for t in tasks])

    def describe(self) -> str:
        """One line for the run's start."""
        return (
            f"Prompts: the task and a newline tokenised by {self.path} ({self.vocab_size} ids, "
            f"padded / cut to {self.max_length} tokens)."
        )


def build_prompt_tokenizer(path: Path, cfg: Any) -> PromptTokenizer:
    """The run's ``PromptTokenizer``, checked against the model before it is built: no id
    past its vocabulary."""
    tokenizer = PromptTokenizer(path, cfg.prompt_length())
    check_vocab(
        tokenizer,
        path,
        cfg.text.vocab_size,
        "use the tokenizer of the checkpoint's backbone (SmolVLM2's for SmolVLA)",
    )
    return tokenizer
