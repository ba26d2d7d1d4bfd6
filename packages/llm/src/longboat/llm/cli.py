"""``longboat-llm``: the LLM stack's command line (``convert`` for now)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _progress_bar(description: str):  # type: ignore[no-untyped-def]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=False,
    )


def _convert(args: argparse.Namespace) -> int:
    from longboat.llm import convert

    if args.direction == "hf-to-native":
        with _progress_bar("loading") as bar:
            task = bar.add_task(f"HF -> native ({args.src})", total=None)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            path = convert.hf_to_native(
                args.src, args.dst, model=args.model, flavor=args.flavor, progress=progress
            )
        print(f"wrote native checkpoint {path}")
    else:
        with _progress_bar("saving") as bar:
            task = bar.add_task(f"native -> HF ({args.src})", total=1)
            path = convert.native_to_hf(args.src, args.dst)
            bar.update(task, completed=1)
        print(f"wrote Hugging Face directory {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``longboat-llm`` argument parser."""
    parser = argparse.ArgumentParser(prog="longboat-llm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="convert between HF directories and native checkpoints")
    conv.add_argument("direction", choices=["hf-to-native", "native-to-hf"])
    conv.add_argument("src", help="HF directory, or native checkpoint (folder or root)")
    conv.add_argument("dst", help="output directory")
    conv.add_argument("--model", help="expected model family (checked against config.json)")
    conv.add_argument("--flavor", help="expected flavor (checked against config.json)")
    conv.set_defaults(func=_convert)
    # Listed for --help; main() hands these to core's stack_main (config composition).
    sub.add_parser("train", help="train an experiment: train experiment=NAME [key=value ...]")
    sub.add_parser("config", help="config show NAME [key=value ...] | config list")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``longboat-llm``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("train", "config"):
        from longboat.core.cli import stack_main

        return stack_main("llm", argv)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"longboat-llm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
