"""``longboat-llm data``: ``prepare`` a token dataset, ``inspect`` one."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["build_data_parser", "data_main"]


def build_data_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the ``prepare`` / ``inspect`` subcommands to ``parser`` (or a new one)."""
    parser = parser or argparse.ArgumentParser(prog="longboat-llm data", description=__doc__)
    sub = parser.add_subparsers(dest="data_command", required=True)
    p = sub.add_parser("prepare", help="tokenise JSONL / Parquet / .txt / a datasets dir")
    p.add_argument("--input", required=True, type=Path, help="file, folder or datasets dir")
    p.add_argument("--tokenizer", required=True, type=Path, help="local HF tokenizer dir")
    p.add_argument("--output", required=True, type=Path, help="dataset dir to write")
    p.add_argument("--format", choices=["pretrain", "sft"], default="pretrain")
    p.add_argument("--text-key", default="text", help="record key of the text (pretrain)")
    p.add_argument("--messages-key", default="messages", help="record key of the turns (sft)")
    p.add_argument(
        "--columns",
        default="",
        help="your record keys under longboat's names, e.g. prompt=question,completion=answer "
        "(sft: messages, conversations, instruction, input, output, prompt, completion, system; "
        "pretrain: text)",
    )
    p.add_argument("--max-seq-len", type=int, default=None, help="sft: longest record kept")
    p.add_argument("--sft-overflow", choices=["truncate", "drop"], default="truncate")
    p.add_argument("--no-eos", action="store_true", help="pretrain: do not append EOS")
    p.add_argument("--workers", type=int, default=1, help="tokeniser processes")
    p.add_argument("--chunk-size", type=int, default=256, help="records per work item")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(data_func=_prepare)
    i = sub.add_parser("inspect", help="counts, length histogram, decoded samples")
    i.add_argument("path", type=Path, help="prepared dataset dir")
    i.add_argument("--tokenizer", type=Path, default=None, help="default: the manifest's")
    i.add_argument("--samples", type=int, default=3, help="decoded documents to show")
    i.set_defaults(data_func=_inspect)
    return parser


def _prepare(args: argparse.Namespace) -> int:
    from longboat.llm.data.prepare import PrepareOptions, prepare_dataset
    from longboat.llm.data.sft_records import parse_columns

    opts = PrepareOptions(
        input=args.input,
        tokenizer=args.tokenizer,
        output=args.output,
        format=args.format,
        text_key=args.text_key,
        messages_key=args.messages_key,
        columns=parse_columns(args.columns),
        max_seq_len=args.max_seq_len,
        sft_overflow=args.sft_overflow,
        append_eos=not args.no_eos,
        workers=args.workers,
        chunk_size=args.chunk_size,
        force=args.force,
    )
    result = prepare_dataset(opts, progress=not args.no_progress)
    if not result.skipped:
        m = result.manifest
        print(
            f"wrote {result.path}: {m['num_docs']:,} documents, {m['num_tokens']:,} tokens "
            f"({m['dtype']}) in {m['build_seconds']:.1f} s"
        )
        print("report: " + ", ".join(f"{k}={v}" for k, v in m["report"].items()))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from longboat.llm.data.inspection import inspect_dataset

    print(inspect_dataset(args.path, tokenizer=args.tokenizer, samples=args.samples))
    return 0


def data_main(argv: Sequence[str] | None = None) -> int:
    """Run ``longboat-llm data <argv>``; 2 with one error line on bad input."""
    args = build_data_parser().parse_args(argv)
    try:
        return int(args.data_func(args))
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"longboat-llm data: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(data_main())
