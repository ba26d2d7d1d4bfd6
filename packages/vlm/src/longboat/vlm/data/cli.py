"""``longboat-vlm data``: ``prepare`` the run's encoded samples once, ``inspect`` files.

``prepare [experiment=<name>] data.cache_dir=<dir> key=value ...`` composes the same
config ``train`` would (default experiment ``sft``), encodes its conversations with the
model's vision processor into a cache entry (``longboat.vlm.data.cache``, with a progress
bar) and prints the packed counts; ``train`` with the same ``data.cache_dir`` and options
reuses the entry instead of encoding again.

``inspect``: what training would see from conversation files.

Reads the files, encodes them with a tokenizer's chat template and the Qwen2.5-VL vision
processor (every image opened and sized, as training does before the model is built),
packs them, and prints the counts (records, kept / skipped samples, tokens, target tokens,
images, videos, rows, fill) and the first rows decoded, each vision run shown as
``<|image_pad|>xN`` and the training targets inside ``[[ ]]``. Bad data exits with 2 and a
message naming the file, row and field.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["build_data_parser", "data_main"]


def build_data_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longboat-vlm data", description=__doc__)
    sub = parser.add_subparsers(dest="data_command", required=True)
    p = sub.add_parser("prepare", help="encode a run's conversations into data.cache_dir once")
    p.add_argument("overrides", nargs="*", help="experiment=<name> and config overrides")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    i = sub.add_parser("inspect", help="counts and decoded packed rows of conversation files")
    i.add_argument("paths", nargs="+", type=Path, help="JSON / JSONL / Parquet files or folders")
    i.add_argument("--tokenizer", required=True, type=Path, help="tokenizer dir (chat template)")
    i.add_argument("--root", type=Path, default=None, help="where media paths start")
    i.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row")
    i.add_argument("--min-pixels", type=int, default=3136, help="smallest resized image area")
    i.add_argument("--max-pixels", type=int, default=1003520, help="largest resized image area")
    i.add_argument("--patch-size", type=int, default=14, help="the vision tower's patch side")
    i.add_argument("--rows", type=int, default=2, help="packed rows to decode")
    i.add_argument("--skip-bad-samples", action="store_true", help="skip and count bad media")
    return parser


def prepare(overrides: Sequence[str], *, progress: bool = True) -> list[str]:
    """Encode the conversations of the run ``overrides`` describe into ``data.cache_dir``
    (reused when there already); returns the summary lines."""
    from longboat.core.config.compose import compose_experiment
    from longboat.core.config.errors import ConfigError
    from longboat.core.train import typed_config
    from longboat.vlm.train.data import open_run_data
    from longboat.vlm.train.training import model_config

    experiment, rest = "sft", []
    for item in overrides:
        if item.startswith("experiment="):
            experiment = item.split("=", 1)[1]
        else:
            rest.append(item)
    cfg = typed_config(compose_experiment(experiment, rest, stack="vlm"))
    if not cfg.data.cache_dir:
        raise ConfigError(
            "is not set: prepare writes the encoded samples there",
            key="data.cache_dir",
            fix="data.cache_dir=<dir>, and pass the same to train",
        )
    if cfg.data.name != "shapes" and not cfg.data.paths:
        raise ConfigError(
            "no conversation files given", key="data.paths", fix="data.paths=[file.jsonl, ...]"
        )
    run = open_run_data(cfg, model_config(cfg), progress=progress, answer_questions=False)
    rows = run.train
    held = f", {len(run.eval)} held-out rows" if run.eval is not None else ""
    return [
        *[n for n in run.notes if n.startswith("Data:")],
        f"{len(rows.samples):,} samples, {rows.num_tokens:,} tokens -> {len(rows):,} packed rows "
        f"of {rows.seq_len} ({rows.fill:.0%} filled){held}.",
    ]


def data_main(argv: Sequence[str] | None = None) -> int:
    """Run ``longboat-vlm data <argv>``; 2 with one message on bad input."""
    args = build_data_parser().parse_args(argv)
    if args.data_command == "prepare":
        from longboat.core.errors import UserError

        try:
            lines = prepare(args.overrides, progress=not args.no_progress)
        except (UserError, FileNotFoundError) as exc:
            print(f"longboat-vlm data: error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0
    from longboat.vlm.data.encoding import load_tokenizer
    from longboat.vlm.data.errors import DataError
    from longboat.vlm.data.inspection import inspect_packed
    from longboat.vlm.data.loading import load_packed_dataset
    from longboat.vlm.data.processor import QwenVisionProcessor, VisionProcessorConfig

    try:
        if not (args.tokenizer / "tokenizer_config.json").is_file():
            raise DataError(f"{args.tokenizer}: no tokenizer_config.json (not a tokenizer dir)")
        tok = load_tokenizer(args.tokenizer)
        processor = QwenVisionProcessor(
            VisionProcessorConfig(
                patch_size=args.patch_size, min_pixels=args.min_pixels, max_pixels=args.max_pixels
            )
        )
        dataset, report = load_packed_dataset(
            [str(p) for p in args.paths],
            tokenizer=tok,
            processor=processor,
            seq_len=args.seq_len,
            tokens_per_second=2,
            root=args.root,
            skip_bad_samples=args.skip_bad_samples,
        )
    except (DataError, FileNotFoundError) as exc:
        print(f"longboat-vlm data: error: {exc}", file=sys.stderr)
        return 2
    print(inspect_packed(dataset, tok, report=report, rows=args.rows))
    return 0
