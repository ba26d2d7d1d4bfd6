"""End-of-run Hugging Face export (LoRA merged) and a greedy generation from the export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.lora import merge_lora
from longboat.llm.hf_checkpoint import save_hf


def export_hf(
    chunks: list[torch.nn.Module],
    cfg: DecoderModelConfig,
    out_dir: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    source_dir: str | Path | None = None,
) -> Path:
    """Merge any LoRA adapters into the base weights and write an HF directory (collective).

    Besides the weights and ``config.json``: the tokenizer (when given) and the special
    tokens ``generate()`` stops and pads with, in ``config.json`` and
    ``generation_config.json`` (the source checkpoint's generation config when it has one,
    else the tokenizer's BOS / EOS / PAD), so ``transformers`` loads one folder and
    generates the way the source model did.
    """
    merge_lora(chunks)
    out = save_hf(chunks, cfg, out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        write_generation_files(out, tokenizer_dir, source_dir)
    if dist.is_initialized():
        dist.barrier()
    return out


_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")


def write_generation_files(
    out: Path, tokenizer_dir: str | Path | None, source_dir: str | Path | None
) -> None:
    """Copy the tokenizer into ``out`` and write the special token ids into its
    ``config.json`` and ``generation_config.json`` (see ``export_hf``)."""
    import json

    from transformers import AutoTokenizer, GenerationConfig

    ids: dict[str, Any] = {}
    if tokenizer_dir is not None:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        tok.save_pretrained(str(out))
        ids = {k: getattr(tok, k, None) for k in _SPECIAL}
    generation = None
    if source_dir is not None and (Path(source_dir) / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(str(source_dir))
        ids.update(
            {
                k: getattr(generation, k)
                for k in _SPECIAL
                if getattr(generation, k, None) is not None
            }
        )
    ids = {k: v for k, v in ids.items() if v is not None}
    if not ids and generation is None:
        return
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config.update(ids)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = generation or GenerationConfig()
    for key, value in ids.items():
        setattr(generation, key, value)
    generation.save_pretrained(str(out))


def chat_prompt(tok: Any, prompt: str) -> str:
    """``prompt`` as the chat template's user turn followed by the assistant's header (the
    text a chat model answers)."""
    return str(
        tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    )


def greedy_generate(
    hf_dir: str | Path,
    prompt: str,
    max_new_tokens: int,
    *,
    repetition_penalty: float = 1.0,
    chat: bool = False,
) -> str:
    """Load ``hf_dir`` with transformers and greedily continue ``prompt``; the decoded text.
    ``chat``: the prompt goes in as a user turn through the tokenizer's chat template and the
    answer alone comes back (up to the export's end-of-turn token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    text = chat_prompt(tok, prompt) if chat else prompt
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            repetition_penalty=repetition_penalty,
            pad_token_id=tok.pad_token_id,
        )
    if chat:
        return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)).strip()
    return str(tok.decode(out[0], skip_special_tokens=True))


def describe_generation(text: str, prompt: str, *, chat: bool = False) -> str:
    """The generation as rich markup: the prompt in bold, the rest escaped (``chat``: the
    user's turn and the assistant's answer on their own lines)."""
    from rich.markup import escape

    if chat:
        return f"[bold]user:[/] {escape(prompt)}\n[bold]assistant:[/] {escape(text)}"
    if text.startswith(prompt):
        return f"[bold]{escape(prompt)}[/]{escape(text[len(prompt) :])}"
    return escape(text)
