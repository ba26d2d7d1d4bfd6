"""``longboat-llm``: ``train`` / ``config`` (core's stack CLI), ``convert``, ``data``,
``generate``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def _progress_bar() -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )


def build_convert_parser() -> argparse.ArgumentParser:
    """The ``longboat-llm convert`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="longboat-llm convert",
        description="Convert between Hugging Face directories and longboat native checkpoints.",
    )
    parser.add_argument("direction", choices=["hf-to-native", "native-to-hf"])
    parser.add_argument("src", help="HF directory, or native checkpoint (step folder or root)")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--model", help="expected model family (checked against config.json)")
    parser.add_argument("--flavor", help="expected flavor (checked against config.json)")
    parser.add_argument(
        "--tokenizer",
        help="native-to-hf: tokenizer dir to ship with the export (default: the training run's)",
    )
    return parser


def convert_main(argv: Sequence[str] | None = None) -> int:
    """Run ``longboat-llm convert <argv>``; 2 with one error message on bad input."""
    args = build_convert_parser().parse_args(argv)
    from longboat.llm import convert

    try:
        if args.direction == "hf-to-native":
            with _progress_bar() as bar:
                task = bar.add_task(f"HF -> native ({args.src})", total=None)

                def progress(done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total)

                path = convert.hf_to_native(
                    args.src, args.dst, model=args.model, flavor=args.flavor, progress=progress
                )
            print(f"wrote native checkpoint {path}")
        else:
            with _progress_bar() as bar:
                task = bar.add_task(f"native -> HF ({args.src})", total=1)
                path = convert.native_to_hf(args.src, args.dst, tokenizer=args.tokenizer)
                bar.update(task, completed=1)
            print(f"wrote Hugging Face directory {path}")
    except (ValueError, FileNotFoundError) as exc:
        print(f"longboat-llm convert: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _commands() -> dict[str, Any]:
    from longboat.llm.generate import generate_main

    commands: dict[str, Any] = {
        "convert": (
            "convert HF <-> native checkpoints (hf-to-native | native-to-hf)",
            convert_main,
        ),
        "generate": ("answer prompts with an export or native checkpoint", generate_main),
    }
    try:
        from longboat.llm.data.cli import data_main
    except ImportError:  # pragma: no cover - the data pipeline is optional at import time
        pass
    else:
        commands["data"] = ("prepare / inspect token datasets", data_main)
    return commands


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``longboat-llm``."""
    from longboat.core.cli import stack_main

    return stack_main("llm", argv, commands=_commands())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
