"""A Hugging Face tokenizer for pi0.5 runs trained from scratch, written with the run and
shipped in its exports, so that LeRobot's pi0.5 preprocessor (which tokenises
``"Task: ..., State: ...;\\nAction: "`` with a Hugging Face tokenizer) reads the same ids
the policy learnt.

It is built locally, nothing downloaded: a byte-level BPE (any text tokenises) whose merges
are learnt from pi0.5's prompt skeleton, every state bin (0..255) and common words of robot
manipulation tasks, so a prompt costs about one token per word and per state dim; ``<pad>``
0, ``<eos>`` 1, ``<bos>`` 2 (added in front of every text, as PaliGemma's), ``<unk>`` 3.
No pretrained language model reads these ids: a policy from a released checkpoint uses the
checkpoint's own tokenizer (``model.tokenizer``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

STAND_IN_VOCAB = 1024
"""Ids of the stand-in (fewer when the model's vocabulary is smaller, down to ``MIN_VOCAB``)."""
MIN_VOCAB = 512
"""A vocabulary below this holds no useful byte-level BPE: the run keeps the byte stand-in."""
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
TASK_WORDS_TEXT = (
    "pick up the a an red green blue yellow white black cube block ball cup bowl plate box "
    "bottle can lid towel cloth drawer door handle button switch object item toy "
    "place put it in into on onto to from of and with then move push pull open close "
    "grasp grab lift lower stack unstack insert remove fold unfold wipe pour turn rotate "
    "slide press hold release left right top bottom front back middle side near far "
    "table shelf sink basket tray bin gripper arm hand robot"
)
TASK_WORDS = tuple(TASK_WORDS_TEXT.split(" "))
"""Words whose merges the stand-in learns (other words tokenise by their bytes)."""


def _corpus() -> list[str]:
    """Prompts in pi0.5's form over every state bin and the task words."""
    bins = [str(b) for b in range(256)]
    lines = []
    for i in range(0, 256, 8):
        words = " ".join(TASK_WORDS[(i // 8 * 7 + k) % len(TASK_WORDS)] for k in range(7))
        lines.append(f"Task: {words}, State: {' '.join(bins[i : i + 8])};\nAction: ")
    return lines * 4


def write_stand_in_tokenizer(directory: str | Path, vocab_size: int) -> Path | None:
    """Write the stand-in into ``directory`` (through a sibling temporary folder, so a
    half-written one is never seen) with at most ``min(vocab_size, STAND_IN_VOCAB)`` ids;
    None where none can be made (``tokenizers`` / ``transformers`` not installed, or a
    vocabulary below ``MIN_VOCAB``)."""
    if vocab_size < MIN_VOCAB:
        return None
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, STAND_IN_VOCAB),
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>",
    )  # fmt: skip
    out = Path(directory)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fast.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
