"""GR00T N1.6's prompt as Isaac-GR00T N1.6 builds it, tokenised with a Hugging Face tokenizer
directory (the ``nvidia/Eagle-Block2A-2B-v2`` tokenizer for released checkpoints).

Isaac-GR00T's ``Gr00tN1d6Processor`` lower-cases the task and drops every character that
is neither a word character nor whitespace (``formalize_language``), puts it in a one-turn
chat (the text, then one image entry per camera) and renders it with the Eagle processor's
chat template; the Eagle processor then replaces each image entry by ``<image k>`` (plain
text), ``<img>``, one ``<IMG_CONTEXT>`` per LM image token and ``</img>``. One sample with
two cameras of 81 tokens each is the string (newlines as shown, nothing else between)::

    <|im_start|>system
    You are a helpful assistant.<|im_end|>
    <|im_start|>user
    pick up the red cube<image 1><img><IMG_CONTEXT>x81</img><image 2><img><IMG_CONTEXT>x81</img><|im_end|>

with a final newline. The batch is tokenised in one call, padded on the left to its longest
row, nothing cut; the backbone puts the camera embeddings where ``<IMG_CONTEXT>`` stands
(``image_tokens_in_text``). Qwen's tokenizer adds no BOS and pads with ``<|endoftext|>``.

Where the tokenizer comes from: ``model.tokenizer=<dir>``; else the ``tokenizer/`` folder
of ``model.init_from`` (what longboat's Isaac-GR00T export writes) or that directory itself
when it holds one (not a Hugging Face backbone's: Qwen3's own tokenizer has no image
tokens). A run from the released Eagle backbone (an Isaac-GR00T directory whose
``model_name`` is ``nvidia/Eagle-Block2A-2B-v2``, or a Qwen3 backbone) without one is a
ConfigError naming ``model.tokenizer``; other runs fall back to the byte-level stand-in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from longboat.core.config.errors import ConfigError

RELEASE_BACKBONE = "nvidia/Eagle-Block2A-2B-v2"
"""The Eagle backbone of the N1.6 release (its Qwen3 reads this tokenizer's ids)."""
TOKENIZER_DIR = "tokenizer"
"""Sub-folder of an exported policy holding its tokenizer."""
SYSTEM_PROMPT = "You are a helpful assistant."
"""The system turn Eagle's chat template adds when a conversation has none."""
IMAGE_CONTEXT = "<IMG_CONTEXT>"
IMAGE_START = "<img>"
IMAGE_END = "</img>"
REQUIRED_TOKENS = ("<|im_start|>", "<|im_end|>", IMAGE_START, IMAGE_END, IMAGE_CONTEXT)
"""Tokens the prompt holds that must each be one id of the tokenizer."""
FIXED_TEXT_BUDGET = 96
"""Tokens beside the image placeholders when every batch is padded to one length."""
FIXED_PER_IMAGE = 8
"""Tokens around each camera's placeholders (``<image k>``, ``<img>``, ``</img>``)."""


def formalize_language(task: str) -> str:
    """The task as Isaac-GR00T's processor spells it: lower case, every character that is
    neither a word character nor whitespace removed."""
    return re.sub(r"[^\w\s]", "", task.lower())


def groot_prompt(task: str, num_images: int, tokens_per_image: int) -> str:
    """One sample's prompt text (module doc)."""
    images = "".join(
        f"<image {k}>{IMAGE_START}{IMAGE_CONTEXT * tokens_per_image}{IMAGE_END}"
        for k in range(1, num_images + 1)
    )
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{formalize_language(task)}{images}<|im_end|>\n"
    )


def has_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` holds a Hugging Face tokenizer (``tokenizer.json``, or a
    ``tokenizer_config.json`` with the vocabulary files of a slow tokenizer)."""
    d = Path(directory)
    return (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()


def find_tokenizer(tokenizer: str | None, init_from: str | None) -> Path | None:
    """The tokenizer directory of a GR00T run (module doc), or None."""
    if tokenizer:
        path = Path(tokenizer)
        if not path.is_dir() or not has_tokenizer(path):
            raise ConfigError(
                "is not a Hugging Face tokenizer directory (no tokenizer.json or "
                "tokenizer_config.json in it)",
                key="model.tokenizer",
                value=tokenizer,
                fix=f"point it at the {RELEASE_BACKBONE} tokenizer files",
            )
        return path
    if not init_from or not Path(init_from).is_dir():
        return None
    from longboat.embodied.models import hf_backbones

    root = Path(init_from)
    if has_tokenizer(root / TOKENIZER_DIR):
        return root / TOKENIZER_DIR
    if has_tokenizer(root) and not hf_backbones.is_hf_backbone(init_from):
        return root
    return None


def needs_tokenizer(init_from: str | None) -> bool:
    """A run whose language model learnt Eagle's Qwen3 tokens: an Isaac-GR00T N1.6
    directory of the release backbone, or a Qwen3 backbone."""
    if not init_from:
        return False
    path = Path(init_from) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False  # resolving the checkpoint names the problem
    if not isinstance(raw, dict):
        return False
    if raw.get("model_type") == "Gr00tN1d6":
        return raw.get("model_name", RELEASE_BACKBONE) == RELEASE_BACKBONE
    return raw.get("model_type") == "qwen3"


def missing_tokenizer_error(init_from: str) -> ConfigError:
    """The error of a run from a pretrained Qwen3 without a tokenizer."""
    return ConfigError(
        f"the language model of model.init_from={init_from} reads prompts tokenised by the "
        f"{RELEASE_BACKBONE} tokenizer (Qwen3 with Eagle's image tokens), and none was given "
        "or found in that directory",
        key="model.tokenizer",
        value=None,
        fix=f"set model.tokenizer=<dir> to the {RELEASE_BACKBONE} tokenizer files (Isaac-GR00T's "
        "N1.6 release ships them in gr00t/model/modules/nvidia/Eagle-Block2A-2B-v2)",
    )


def copy_tokenizer(source: str | Path, directory: str | Path) -> Path:
    """Write the tokenizer of ``source`` into ``directory`` (``save_pretrained``: a slow
    tokenizer's vocabulary files become one ``tokenizer.json``); returns it."""
    out = Path(directory)
    _load(Path(source)).save_pretrained(str(out))
    return out


def _load(path: Path) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ConfigError(
            "needs the transformers package to read a Hugging Face tokenizer",
            key="model.tokenizer",
            value=str(path),
            fix="pip install 'transformers>=5'",
        ) from err
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # transformers raises many error types for a bad directory
        raise ConfigError(
            f"could not be loaded by transformers.AutoTokenizer ({err})",
            key="model.tokenizer",
            value=str(path),
        ) from err


class GrootPromptTokenizer:
    """GR00T N1.6 prompts (``groot_prompt``) tokenised as Isaac-GR00T does."""

    def __init__(self, path: str | Path, model_cfg: Any) -> None:
        """Loads the tokenizer and checks it against ``model_cfg`` (a ``GrootN16Config``):
        every ``REQUIRED_TOKENS`` entry is one id, ``<IMG_CONTEXT>`` is the model's
        ``image_token_id``, a pad token exists and no id reaches the LM's vocabulary (a
        ConfigError naming ``model.tokenizer`` otherwise)."""
        image_token_id, vocab_size = model_cfg.image_token_id, model_cfg.llm.vocab_size
        self.model_cfg = model_cfg
        self.path = Path(path)
        self.tokenizer: Any = _load(self.path)
        problems = []
        for token in REQUIRED_TOKENS:
            ids = self.tokenizer(token, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                problems.append(f"{token} is not one token (it splits into {len(ids)})")
        context = self.tokenizer.convert_tokens_to_ids(IMAGE_CONTEXT)
        if not problems and context != image_token_id:
            problems.append(
                f"{IMAGE_CONTEXT} is id {context}, the model's image token is {image_token_id}"
            )
        if self.tokenizer.pad_token_id is None:
            problems.append("it has no pad token (Qwen's is <|endoftext|>)")
        if len(self.tokenizer) > vocab_size:
            problems.append(
                f"it has {len(self.tokenizer)} ids, more than the model's vocabulary of "
                f"{vocab_size}"
            )
        if problems:
            raise ConfigError(
                "cannot tokenise GR00T N1.6 prompts: " + "; ".join(problems),
                key="model.tokenizer",
                value=str(path),
                fix=f"use the {RELEASE_BACKBONE} tokenizer (Qwen3 + <img>, </img>, "
                "<IMG_CONTEXT>), the one the checkpoint was trained with",
            )

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can emit (added tokens included)."""
        return len(self.tokenizer)

    def __call__(
        self,
        tasks: Sequence[str],
        states: Sequence[torch.Tensor] | None = None,
        *,
        image_hw: tuple[int, int],
        num_cameras: int,
        fixed_length: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tasks -> (input_ids int64 [B, L], attention_mask bool [B, L]) for frames of
        ``image_hw`` from ``num_cameras`` cameras: left-padded to the longest prompt, or with
        ``fixed_length`` to ``fixed_length_for`` tokens (one shape for every batch; a longer
        prompt is a ValueError). ``states`` are not part of GR00T's prompt."""
        del states
        tokens = self.model_cfg.tokens_per_image(*image_hw)
        prompts = [groot_prompt(t, num_cameras, tokens) for t in tasks]
        if not fixed_length:
            out = self.tokenizer(
                prompts, padding="longest", padding_side="left", return_tensors="pt"
            )
            return out["input_ids"].to(torch.int64), out["attention_mask"].to(torch.bool)
        length = self.fixed_length_for(num_cameras, tokens)
        out = self.tokenizer(prompts)
        longest = max(map(len, out["input_ids"]))
        if longest > length:
            raise ValueError(
                f"a prompt of {longest} tokens does not fit the fixed length of {length} "
                f"(train.cuda_graph pads every batch to it: {FIXED_TEXT_BUDGET} text tokens "
                "besides the images); shorten the task or set train.cuda_graph=false"
            )
        padded = self.tokenizer.pad(
            out, padding="max_length", max_length=length, padding_side="left", return_tensors="pt"
        )
        return padded["input_ids"].to(torch.int64), padded["attention_mask"].to(torch.bool)

    @staticmethod
    def fixed_length_for(num_cameras: int, tokens_per_image: int) -> int:
        """The prompt length of ``fixed_length`` batches."""
        return num_cameras * (tokens_per_image + FIXED_PER_IMAGE) + FIXED_TEXT_BUDGET

    def describe(self) -> str:
        """One line for the run's start."""
        return (
            "Prompts: Isaac-GR00T N1.6's chat prompt (the task lower-cased without "
            "punctuation, then per camera <image k><img>, one <IMG_CONTEXT> per image token, "
            f"</img>) tokenised by {self.path} ({self.vocab_size} ids, left-padded)."
        )
