"""Tiny random Wan encoders saved as a diffusers-style directory (tests, trying ``prepare``).

:func:`build_tiny_wan_encoders` writes ``vae/`` (an ``AutoencoderKLWan`` with 16 latent
channels, 4x temporal and 8x spatial compression, a few thousand weights), ``text_encoder/``
(a 2-layer ``UMT5EncoderModel``) and ``tokenizer/`` (a small unigram tokenizer, T5-style:
``<pad>`` 0, ``</s>`` 1 appended to every text, ``<unk>`` 2, trained on the texts given). The
weights are random (seeded): the latents mean nothing, but every code path of ``prepare`` runs
as with the real models.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = ["build_tiny_tokenizer", "build_tiny_wan_encoders"]

_BASE_TEXTS = (
    "a red square moving left",
    "a green circle moving right on a dark background",
    "a blue ball bouncing up and down",
    "a yellow car driving along a road at night",
    "waves on the sea under a cloudy sky",
    "a cat sitting on a chair next to the window",
)


def build_tiny_tokenizer(
    texts: Iterable[str], out_dir: str | Path, *, vocab_size: int = 200
) -> Path:
    """Train a unigram tokenizer on ``texts`` and save it (``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=specials, unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator([*_BASE_TEXTS, *texts], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


def tiny_t5_settings(vocab: int, width: int) -> dict[str, Any]:
    """The config of a 2-layer T5-style text encoder ``width`` wide (UMT5 for Wan, T5 for
    FLUX's tiny pipelines)."""
    return dict(
        vocab_size=vocab,
        d_model=width,
        d_kv=8,
        d_ff=2 * width,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def build_tiny_wan_encoders(
    out_dir: str | Path, *, texts: Iterable[str] = (), text_dim: int = 32, seed: int = 0
) -> Path:
    """Write tiny random ``vae/``, ``text_encoder/`` and ``tokenizer/`` into ``out_dir``."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    out = Path(out_dir)
    tok_dir = build_tiny_tokenizer(texts, out / "tokenizer")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    )
    vae.save_pretrained(out / "vae")
    cfg = UMT5Config(**tiny_t5_settings(vocab, text_dim))
    UMT5EncoderModel(cfg).save_pretrained(out / "text_encoder")
    return out
