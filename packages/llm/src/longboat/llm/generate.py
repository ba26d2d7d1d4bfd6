"""``longboat-llm generate``: look at what a run learned without writing code.

The model is a Hugging Face directory (a run's export) or a native checkpoint (a step
folder or a checkpoint root, converted to a temporary HF directory first, with the training
run's tokenizer). Each prompt goes in as a user turn through the tokenizer's chat template
(``--raw``: continued as plain text) and is answered greedily by ``transformers``, stopping
at the model's end-of-sequence token. Prompts come from ``--prompt`` (repeatable) or
``--prompts FILE``: a ``.txt`` file (one prompt a line) or JSON lines with a ``prompt`` (or
``text``) key.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["ChatGenerator", "generate_main", "read_prompts"]


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a ``.txt`` (one a line, blank lines skipped) or JSON-lines file (a
    ``prompt`` or ``text`` key per record); ``ValueError`` naming the file and line."""
    f = Path(path)
    if not f.is_file():
        raise ValueError(f"--prompts {f} does not exist")
    lines = f.read_text(encoding="utf-8").splitlines()
    if f.suffix not in (".jsonl", ".json"):
        return [line.strip() for line in lines if line.strip()]
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{f}:{n}: not valid JSON ({exc.msg})") from None
        text = record.get("prompt", record.get("text")) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{f}:{n}: a record needs a 'prompt' (or 'text') string")
        prompts.append(text)
    return prompts


class ChatGenerator:
    """A Hugging Face causal LM and its tokenizer, loaded once, answering prompts greedily."""

    def __init__(self, hf_dir: str | Path, *, chat: bool | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.tok = AutoTokenizer.from_pretrained(str(hf_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        self.model.eval()
        has_template = bool(getattr(self.tok, "chat_template", None))
        if chat and not has_template:
            raise ValueError(f"{hf_dir}: the tokenizer has no chat template; pass --raw")
        self.chat = has_template if chat is None else chat

    def prompt_text(self, prompt: str) -> str:
        """What the model is fed for ``prompt``: its chat rendering, or the prompt itself."""
        from longboat.llm.train.export import chat_prompt

        return chat_prompt(self.tok, prompt) if self.chat else prompt

    def answer(self, prompt: str, max_new_tokens: int) -> str:
        """The greedy continuation of ``prompt`` (new tokens only, special tokens dropped)."""
        import torch

        ids = self.tok(self.prompt_text(prompt), return_tensors="pt", add_special_tokens=False)
        ids = ids["input_ids"]
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.tok.pad_token_id,
            )
        return str(self.tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)).strip()


@contextmanager
def hf_directory(model: str | Path, tokenizer: str | Path | None = None) -> Iterator[Path]:
    """``model`` itself when it is a Hugging Face directory; a native checkpoint converted
    into a temporary one (removed afterwards) otherwise."""
    path = Path(model)
    if (path / "config.json").is_file():
        yield path
        return
    if not path.exists():
        raise ValueError(f"{path} does not exist; pass an HF directory or a native checkpoint")
    from longboat.llm.convert import native_to_hf

    with tempfile.TemporaryDirectory(prefix="longboat-generate-") as tmp:
        yield native_to_hf(path, Path(tmp) / "hf", tokenizer=tokenizer)


def build_generate_parser() -> argparse.ArgumentParser:
    """The ``longboat-llm generate`` argument parser."""
    p = argparse.ArgumentParser(
        prog="longboat-llm generate",
        description="Answer prompts greedily with a run's export or native checkpoint.",
    )
    p.add_argument("model", help="HF directory (a run's export) or native checkpoint")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", type=Path, help=".txt (one a line) or .jsonl ('prompt' key)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--raw", action="store_true", help="continue the text, no chat template")
    p.add_argument("--tokenizer", help="native checkpoints: tokenizer dir (default: the run's)")
    p.add_argument("--output", type=Path, help="also write {prompt, answer} JSON lines here")
    return p


def generate_main(argv: Sequence[str] | None = None) -> int:
    """Run ``longboat-llm generate <argv>``; 2 with one error line on bad input."""
    args = build_generate_parser().parse_args(argv)
    try:
        prompts = list(args.prompt) + (read_prompts(args.prompts) if args.prompts else [])
        if not prompts:
            raise ValueError("no prompt: pass --prompt TEXT or --prompts FILE")
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
        rows: list[dict[str, Any]] = []
        with hf_directory(args.model, args.tokenizer) as hf_dir:
            gen = ChatGenerator(hf_dir, chat=False if args.raw else None)
            for prompt in prompts:
                answer = gen.answer(prompt, args.max_new_tokens)
                rows.append({"prompt": prompt, "answer": answer})
                print(f"### {prompt}\n{answer}\n", flush=True)
    except (ValueError, FileNotFoundError) as exc:
        print(f"longboat-llm generate: error: {exc}", file=sys.stderr)
        return 2
    if args.output is not None:
        args.output.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return 0
