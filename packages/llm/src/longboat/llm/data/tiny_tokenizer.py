"""A small byte-level BPE tokenizer trained in seconds (tests, quickstart, offline demos).

Saved as a ``transformers`` tokenizer directory with a chat template, so everything that
takes "a local Hugging Face tokenizer directory" accepts it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "train_tiny_tokenizer"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|eot|>"]

# Every turn is "<|role|>content<|eot|>"; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tiny_tokenizer(
    texts: Iterable[str], out_dir: str | Path, *, vocab_size: int = 300
) -> Path:
    """Train a byte-level BPE on ``texts`` and save it (with :data:`CHAT_TEMPLATE`) to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out
