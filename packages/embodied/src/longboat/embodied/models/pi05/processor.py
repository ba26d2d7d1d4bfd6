"""pi0.5's prompt as LeRobot 0.6.1's pi05 preprocessor (and openpi) build it, tokenised with
a Hugging Face tokenizer directory (PaliGemma's for released checkpoints).

The prompt of one sample is ``"Task: <task>, State: <bins>;\\nAction: "``: the task with
surrounding whitespace stripped and ``_`` / newlines turned into spaces, and the state
(normalised to [-1, 1], the dataset's own width, unpadded) as 256-bin indices
(``np.digitize(state, linspace(-1, 1, 257)[:-1]) - 1``) joined by spaces. It is tokenised
in one call, ``tokenizer(prompts, max_length=L, truncation=True, padding="max_length",
padding_side="right")`` with ``L`` = LeRobot's ``tokenizer_max_length`` (the tokenizer adds
its BOS), giving ``input_ids`` and a boolean ``attention_mask`` of ``L`` tokens. The policy
then embeds no separate state tokens (``Pi05Config.state_in_prompt``).

Where the tokenizer comes from: ``model.tokenizer=<dir>``; else the ``tokenizer/`` folder of
``model.init_from`` (what longboat's LeRobot export writes), that directory itself, or the
local directory its ``policy_preprocessor.json`` names. A pretrained pi0.5 run
(``needs_tokenizer``) without one is a ConfigError naming ``model.tokenizer``; only
from-scratch runs fall back to the byte-level stand-in (``train.policy_batch.ByteTokenizer``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longboat.core.config.errors import ConfigError
from longboat.embodied.models.common.prompt_tokenizer import FixedLengthTokenizer, check_vocab

PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"
"""The Hub name LeRobot's pi0.5 preprocessor loads its tokenizer from."""
TOKENIZER_DIR = "tokenizer"
"""Sub-folder of an exported policy holding its tokenizer files."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
"""The files a Hugging Face tokenizer directory may hold (copied into exports)."""
STATE_BINS = 256


def clean_task(task: str) -> str:
    """The task text as the prompt spells it (LeRobot's cleaning)."""
    return task.strip().replace("_", " ").replace("\n", " ")


def state_bins(state: np.ndarray | torch.Tensor, num_bins: int = STATE_BINS) -> np.ndarray:
    """[..., D] normalised state -> [..., D] int bin indices, ``np.digitize`` on float64 edges
    (values below -1 give -1, values at or above the last edge ``num_bins - 1``)."""
    if isinstance(state, torch.Tensor):
        state = state.detach().cpu().float().numpy()
    edges = np.linspace(-1, 1, num_bins + 1)[:-1]
    return np.digitize(state, bins=edges) - 1


def pi05_prompt(task: str, state: np.ndarray | torch.Tensor) -> str:
    """One sample's prompt: ``"Task: <cleaned task>, State: <bins>;\\nAction: "``."""
    bins = " ".join(map(str, state_bins(state).reshape(-1).tolist()))
    return f"Task: {clean_task(task)}, State: {bins};\nAction: "


def has_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` holds a Hugging Face tokenizer (tokenizer.json or its config)."""
    d = Path(directory)
    return (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()


def _named_by_processor(init_from: Path) -> Path | None:
    """The local tokenizer directory a LeRobot ``policy_preprocessor.json`` names, if any."""
    path = init_from / "policy_preprocessor.json"
    if not path.is_file():
        return None
    try:
        steps = json.loads(path.read_text()).get("steps", [])
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    for step in steps:
        name = (step.get("config") or {}).get("tokenizer_name")
        if step.get("registry_name") == "tokenizer_processor" and name:
            candidate = Path(name) if Path(name).is_absolute() else init_from / name
            return candidate if has_tokenizer(candidate) else None
    return None


def find_tokenizer(tokenizer: str | None, init_from: str | None) -> Path | None:
    """The tokenizer directory of a pi0.5 run (module doc), or None (none given or found)."""
    if tokenizer:
        path = Path(tokenizer)
        if not path.is_dir() or not has_tokenizer(path):
            raise ConfigError(
                "is not a Hugging Face tokenizer directory (no tokenizer.json or "
                "tokenizer_config.json in it)",
                key="model.tokenizer",
                value=tokenizer,
                fix=f"point it at a saved tokenizer, e.g. the files of {PALIGEMMA_TOKENIZER} "
                "(hf download google/paligemma-3b-pt-224 --include 'tokenizer*' --local-dir DIR)",
            )
        return path
    if not init_from or not Path(init_from).is_dir():
        return None
    root = Path(init_from)
    for candidate in (root / TOKENIZER_DIR, root):
        if has_tokenizer(candidate):
            return candidate
    return _named_by_processor(root)


def needs_tokenizer(init_from: str | None) -> bool:
    """A pretrained pi0.5 run: ``init_from`` is a LeRobot pi05 policy or a PaliGemma / Gemma
    backbone (their language model reads PaliGemma's token ids)."""
    if not init_from:
        return False
    from longboat.embodied.models import hf_backbones

    if hf_backbones.is_hf_backbone(init_from):
        raw = json.loads((Path(init_from) / "config.json").read_text())
        return str(raw.get("model_type", "")) in ("paligemma", "gemma")
    return True


def missing_tokenizer_error(init_from: str) -> ConfigError:
    """The error of a pretrained pi0.5 run without a tokenizer."""
    return ConfigError(
        f"a pretrained pi0.5 (model.init_from={init_from}) reads prompts tokenised by "
        f"PaliGemma's tokenizer, and none was given or found in that directory",
        key="model.tokenizer",
        value=None,
        fix=f"set model.tokenizer=<dir> to the files of {PALIGEMMA_TOKENIZER} "
        "(hf download google/paligemma-3b-pt-224 --include 'tokenizer*' --local-dir DIR)",
    )


def copy_tokenizer(source: str | Path, directory: str | Path) -> Path:
    """Copy the tokenizer files of ``source`` into ``directory`` (created); returns it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, out / name)
    return out


class PromptTokenizer(FixedLengthTokenizer):
    """pi0.5 prompts (``pi05_prompt``) tokenised to ``max_length`` ids as LeRobot does."""

    def __call__(
        self, tasks: Sequence[str], states: Sequence[torch.Tensor], **layout: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tasks and normalised states (each [D], unpadded) -> (input_ids int64 [B, L],
        attention_mask bool [B, L]). ``layout`` (the frames' size, the camera count, a fixed
        length) is read past: pi0.5's prompt holds no image tokens and is always
        ``max_length`` long."""
        del layout
        prompts = [pi05_prompt(t, s) for t, s in zip(tasks, states, strict=True)]
        return self.tokenize(prompts)

    def describe(self) -> str:
        """One line for the run's start."""
        return (
            f"Prompts: pi0.5's 'Task: ..., State: ...;\\nAction: ' tokenised by {self.path} "
            f"({self.vocab_size} ids, padded / cut to {self.max_length} tokens)."
        )


def build_prompt_tokenizer(path: Path, cfg: Any) -> PromptTokenizer:
    """The run's ``PromptTokenizer`` (LeRobot's ``tokenizer_max_length`` tokens), checked
    against the model before it is built: no id past its vocabulary."""
    tokenizer = PromptTokenizer(path, cfg.prompt_length())
    check_vocab(
        tokenizer,
        path,
        cfg.llm.vocab_size,
        "use the tokenizer the checkpoint was trained with (PaliGemma's for pi0.5)",
    )
    return tokenizer
