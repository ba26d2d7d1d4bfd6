"""A small byte-level BPE tokenizer with Qwen-VL's special tokens (tests, quickstart).

Saved as a ``transformers`` tokenizer directory (``PreTrainedTokenizerFast``) with a
Qwen-style chat template: every turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``,
the generation prompt opens an assistant turn, and content may be a string (placeholders
already written as vision markup) or a list of ``{"type": "text" | "image" | "video"}``
parts, which render as Qwen2-VL's do (``<|vision_start|><|image_pad|><|vision_end|>``), so
transformers' ``Qwen2_5_VLProcessor.apply_chat_template`` works with it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "VLMTokenizerInfo", "build_vlm_tokenizer"]

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class VLMTokenizerInfo:
    """Where the tokenizer was saved and the ids a model config needs."""

    path: Path
    vocab_size: int
    """Number of tokens (the model's vocabulary must be at least this)."""
    pad_token_id: int
    eos_token_id: int
    """``<|im_end|>``: a generated answer ends with it."""
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


def build_vlm_tokenizer(
    texts: Iterable[str], out_dir: str | Path, *, vocab_size: int = 384
) -> VLMTokenizerInfo:
    """Train a byte-level BPE on ``texts`` and save it with the chat template to ``out_dir``.

    ``vocab_size`` counts the 256 byte symbols and the special tokens; at least 263.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    floor = 256 + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size} must be >= {floor} (bytes + special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    ids = fast.convert_tokens_to_ids
    return VLMTokenizerInfo(
        path=out,
        vocab_size=len(fast),
        pad_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
