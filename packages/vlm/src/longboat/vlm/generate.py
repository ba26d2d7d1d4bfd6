"""``longboat-vlm generate``: ask a run's export or native checkpoint questions about images.

The model is a Hugging Face directory a run wrote (its export) or a native checkpoint (a
step folder or a ``checkpoint.dir``, written first into a temporary Hugging Face directory
as the run's export would be: ``longboat.vlm.convert.native_to_hf``, with the run's
tokenizer). It is loaded with ``transformers``; each prompt goes in as a user turn through the tokenizer's chat template,
each ``<image>`` in it (or, without one, the images before the text) becomes the model's
vision tokens, the images are resized as in training (transformers' PIL image processor
with the export's ``preprocessor_config.json``), and the answer is greedy, up to the
end-of-turn token. Prompts come from ``--prompt`` (with ``--image``, repeatable) or
``--prompts FILE``: JSON lines with ``prompt`` and ``image`` / ``images`` (paths relative to
the file's folder).
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

__all__ = ["VisionChatGenerator", "generate_main", "read_prompts"]

IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
"""What an image is in the Qwen-VL chat text before the processor expands its pads."""


def read_prompts(path: str | Path) -> list[tuple[str, list[Path]]]:
    """``(prompt, image paths)`` of each JSON line of ``path``; ``ValueError`` naming the file
    and line."""
    f = Path(path)
    if not f.is_file():
        raise ValueError(f"--prompts {f} does not exist")
    out = []
    for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{f}:{n}: not valid JSON ({exc.msg})") from None
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str):
            raise ValueError(f"{f}:{n}: a record needs a 'prompt' string (and 'image'/'images')")
        images = record.get("images", record.get("image", []))
        images = [images] if isinstance(images, str) else list(images or [])
        out.append((prompt, [f.parent / p for p in images]))
    return out


class VisionChatGenerator:
    """A VLM export, its tokenizer and processor, loaded once, answering greedily."""

    def __init__(self, hf_dir: str | Path) -> None:
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        d = Path(hf_dir)
        if not (d / "config.json").is_file():
            raise ValueError(f"{d} is not a Hugging Face directory (no config.json)")
        self.processor = AutoProcessor.from_pretrained(str(d))
        # The PIL backend resizes exactly as the training data was resized.
        self.processor.image_processor = AutoImageProcessor.from_pretrained(str(d), backend="pil")
        self.tok = self.processor.tokenizer
        self.model = AutoModelForImageTextToText.from_pretrained(str(d)).eval()

    def chat_text(self, prompt: str, num_images: int) -> str:
        """The chat template's text of ``prompt`` with ``num_images`` images."""
        if "<image>" in prompt:
            if prompt.count("<image>") != num_images:
                raise ValueError(
                    f"the prompt has {prompt.count('<image>')} <image> placeholder(s) for "
                    f"{num_images} image(s): {prompt[:60]!r}"
                )
            content = prompt.replace("<image>", IMAGE_MARKUP)
        else:
            content = IMAGE_MARKUP * num_images + prompt
        messages = [{"role": "user", "content": content}]
        return str(
            self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )

    def inputs(self, prompt: str, images: Sequence[Path]) -> Any:
        """The model inputs of ``prompt`` about ``images``: token ids with the vision pads
        expanded, pixels and grids."""
        from PIL import Image

        for p in images:
            if not Path(p).is_file():
                raise ValueError(f"image {p} does not exist")
        pictures = [Image.open(p).convert("RGB") for p in images]
        return self.processor(
            text=[self.chat_text(prompt, len(pictures))],
            images=pictures or None,
            return_tensors="pt",
        )

    def answer(self, prompt: str, images: Sequence[Path], max_new_tokens: int) -> str:
        """The greedy answer to ``prompt`` about ``images`` (new tokens only)."""
        import torch

        inputs = self.inputs(prompt, images)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1] :]
        return str(self.tok.decode(new, skip_special_tokens=True)).strip()


@contextmanager
def hf_directory(model: str | Path, tokenizer: str | Path | None = None) -> Iterator[Path]:
    """``model`` itself when it is a Hugging Face directory; a native checkpoint written into
    a temporary one (removed afterwards) otherwise."""
    path = Path(model)
    if (path / "config.json").is_file():
        yield path
        return
    if not path.exists():
        raise ValueError(f"{path} does not exist; pass a run's HF export or native checkpoint")
    from longboat.vlm.convert import native_to_hf

    with tempfile.TemporaryDirectory(prefix="longboat-vlm-generate-") as tmp:
        yield native_to_hf(path, Path(tmp) / "hf", tokenizer=tokenizer)


def build_generate_parser() -> argparse.ArgumentParser:
    """The ``longboat-vlm generate`` argument parser."""
    p = argparse.ArgumentParser(
        prog="longboat-vlm generate",
        description="Answer questions about images with a VLM run's export or checkpoint.",
    )
    p.add_argument("model", help="the run's HF export, or a native checkpoint (step folder)")
    p.add_argument("--prompt", help="a question (with --image)")
    p.add_argument("--image", action="append", default=[], type=Path, help="an image (repeatable)")
    p.add_argument("--prompts", type=Path, help="JSON lines: prompt, image / images")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--tokenizer", help="native checkpoints: tokenizer dir (default: the run's)")
    p.add_argument("--output", type=Path, help="also write {prompt, images, answer} JSON lines")
    return p


def generate_main(argv: Sequence[str] | None = None) -> int:
    """Run ``longboat-vlm generate <argv>``; 2 with one error line on bad input."""
    args = build_generate_parser().parse_args(argv)
    try:
        asks = [(args.prompt, list(args.image))] if args.prompt is not None else []
        asks += read_prompts(args.prompts) if args.prompts else []
        if not asks:
            raise ValueError("no prompt: pass --prompt TEXT [--image PATH] or --prompts FILE")
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
        rows: list[dict[str, Any]] = []
        with hf_directory(args.model, args.tokenizer) as hf_dir:
            gen = VisionChatGenerator(hf_dir)
            for prompt, images in asks:
                answer = gen.answer(prompt, images, args.max_new_tokens)
                images_text = [str(p) for p in images]
                rows.append({"prompt": prompt, "images": images_text, "answer": answer})
                print(f"### {prompt}\n{answer}\n", flush=True)
    except (ValueError, FileNotFoundError) as exc:
        print(f"longboat-vlm generate: error: {exc}", file=sys.stderr)
        return 2
    if args.output is not None:
        args.output.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return 0
