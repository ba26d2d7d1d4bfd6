"""Tiny random diffusers pipelines of every family, for trying the whole path on a CPU.

``build_tiny_pipeline(family, out_dir)`` writes a diffusers pipeline directory that
``DiffusionPipeline.from_pretrained`` loads and samples, with every component small and
random (seeded): the family's ``tiny`` transformer, a VAE with 16 latent channels, the text
encoder(s) and tokenizer(s) of the family's pipeline and its flow-matching scheduler.

- ``wan``: ``WanPipeline`` with the tiny Wan VAE, 2-layer UMT5 and unigram tokenizer of
  :func:`~longboat.diffusion.data.tiny_encoders.build_tiny_wan_encoders` (text width 32).
- ``flux``: ``FluxPipeline`` with a 2-block ``AutoencoderKL`` (2x spatial compression), a
  2-layer CLIP text model (pooled width 32) and a 2-layer T5 encoder (width 32), each with a
  small unigram tokenizer.

``data prepare model_dir=<dir>`` encodes with these encoders, ``train model.init_from=<dir>``
starts from the transformer, and the run's export is again a pipeline of this kind. The
samples mean nothing; every code path runs as with the released models.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["TINY_PIPELINE_FAMILIES", "build_tiny_pipeline"]

TINY_PIPELINE_FAMILIES = ("wan", "flux")
"""Families ``build_tiny_pipeline`` builds."""


def _transformer(family: str) -> Any:
    from longboat.diffusion.models.registry import get_family

    impl = get_family(family).load()
    import diffusers

    cls = getattr(diffusers, impl.DIFFUSERS_CLASS)
    return cls(**impl.flavor("tiny").to_diffusers())


def _wan(out: Path, texts: Iterable[str], seed: int) -> None:
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    from longboat.diffusion.data.tiny_encoders import build_tiny_wan_encoders

    enc = build_tiny_wan_encoders(out / ".encoders", texts=texts, seed=seed)
    torch.manual_seed(seed + 1)
    pipe = WanPipeline(
        tokenizer=AutoTokenizer.from_pretrained(enc / "tokenizer"),
        text_encoder=UMT5EncoderModel.from_pretrained(enc / "text_encoder"),
        vae=AutoencoderKLWan.from_pretrained(enc / "vae"),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=_transformer("wan"),
    )
    pipe.save_pretrained(out)
    import shutil

    shutil.rmtree(enc)


def _flux(out: Path, texts: Iterable[str], seed: int) -> None:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from longboat.diffusion.data.tiny_encoders import build_tiny_tokenizer, tiny_t5_settings

    texts = list(texts)
    clip_tok = AutoTokenizer.from_pretrained(build_tiny_tokenizer(texts, out / ".tok_clip"))
    clip_tok.model_max_length = 77
    t5_tok = AutoTokenizer.from_pretrained(build_tiny_tokenizer(texts, out / ".tok_t5"))
    torch.manual_seed(seed)
    width = 32  # the tiny FLUX transformer's joint_attention_dim and pooled_projection_dim
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            projection_dim=width,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
        )
    )
    t5 = T5EncoderModel(T5Config(**tiny_t5_settings(len(t5_tok), width)))
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
        transformer=_transformer("flux"),
    )
    pipe.save_pretrained(out)
    import shutil

    shutil.rmtree(out / ".tok_clip")
    shutil.rmtree(out / ".tok_t5")


def build_tiny_pipeline(
    family: str, out_dir: str | Path, *, texts: Iterable[str] = (), seed: int = 0
) -> Path:
    """Write a tiny random diffusers pipeline of ``family`` (``wan`` or ``flux``) into
    ``out_dir``; its tokenizers are trained on ``texts`` (and a few built-in captions)."""
    if family not in TINY_PIPELINE_FAMILIES:
        raise ValueError(
            f"family={family!r}: tiny pipelines exist for {', '.join(TINY_PIPELINE_FAMILIES)}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (_wan if family == "wan" else _flux)(out, texts, seed)
    return out
