"""End-of-run Hugging Face export (LoRA merged) and a greedy generation from the export."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from longboat.llm.config import LLMModelConfig
from longboat.llm.hf import save_hf
from longboat.llm.lora import merge_lora


def export_hf(
    chunks: list[torch.nn.Module],
    cfg: LLMModelConfig,
    out_dir: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Merge any LoRA adapters into the base weights and write an HF directory (collective).

    The tokenizer, when given, is saved next to the weights so ``transformers`` loads both
    from one folder.
    """
    merge_lora(chunks)
    out = save_hf(chunks, cfg, out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and tokenizer_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    if dist.is_initialized():
        dist.barrier()
    return out


def greedy_generate(
    hf_dir: str | Path, prompt: str, max_new_tokens: int, *, repetition_penalty: float = 1.0
) -> str:
    """Load ``hf_dir`` with transformers and greedily continue ``prompt``; the decoded text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            repetition_penalty=repetition_penalty,
            pad_token_id=tok.pad_token_id,
        )
    return str(tok.decode(out[0], skip_special_tokens=True))


def describe_generation(text: str, prompt: str) -> str:
    """The generation as rich markup: the prompt in bold, the rest escaped."""
    from rich.markup import escape

    if text.startswith(prompt):
        return f"[bold]{escape(prompt)}[/]{escape(text[len(prompt) :])}"
    return escape(text)
