"""A trained run's export in its policy's reference format, from the command line (the end
of a run writes the same itself, ``export.format``):

    python -m longboat.embodied.train.lerobot_export <run>/export <out_dir> \\
        --dataset /data/my_lerobot_dataset [--format NAME] [--tokenizer DIR] \\
        [--lerobot-backbone DIR]

The policy of the export (its ``config.json``) names the formats it is written in
(``PolicyFamily.export_formats``; the first by default): pi0.5 as a LeRobot policy
directory (``--tokenizer``: the tokenizer to ship, default the run's), GR00T N1.6 in the
Isaac-GR00T release layout (``--lerobot-backbone``: a LeRobot groot policy around that
checkpoint's backbone instead).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from longboat.core.config.errors import ConfigError
from longboat.embodied.models.registry import policy
from longboat.embodied.train.export import CONFIG_NAME
from longboat.embodied.train.reference_formats import copy_processor


def convert_export(
    export_dir: Path, out_dir: Path, *, dataset: Path, fmt: str | None = None, **options: Path
) -> tuple[str, Path]:
    """Convert the native export ``export_dir`` into ``fmt`` (default: its policy's first
    reference format) in ``out_dir``; returns (the format's label, ``out_dir``)."""
    name = json.loads((Path(export_dir) / CONFIG_NAME).read_text()).get("model_name")
    family = policy(str(name))
    formats = [f.name for f in family.export_formats]
    chosen = family.export_format(fmt) if fmt else next(iter(family.export_formats), None)
    if chosen is None:
        raise ConfigError(
            f"{export_dir} holds a {name} policy, written in "
            + (", ".join(formats) if formats else "no reference format"),
            key="--format",
            value=fmt,
            fix=f"use one of {', '.join(formats)}" if formats else "keep the native export",
        )
    try:
        written = chosen.convert(export_dir, out_dir, dataset=dataset, **options)
    except TypeError as exc:  # an option the format does not take
        raise ConfigError(
            f"{chosen.name} ({name}) does not take {', '.join(options)}: {exc}",
            key="--" + next(iter(options), "format").replace("_", "-"),
        ) from None
    if "lerobot_backbone" not in options:  # another backbone: not this run's policy to act with
        copy_processor(Path(export_dir), written)
    return chosen.label, written


def main(argv: list[str] | None = None) -> None:
    """Command line: export_dir out_dir --dataset root [--format] [--tokenizer] [--lerobot-backbone]."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dataset", type=Path, required=True, help="the LeRobot dataset root")
    parser.add_argument("--format", default=None, help="default: the policy's first format")
    parser.add_argument(
        "--lerobot-backbone",
        type=Path,
        default=None,
        help="groot_n1_6 only: a LeRobot groot policy whose N1.7 backbone the output keeps",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="pi05 only: the tokenizer directory to ship (default: the run's model.tokenizer)",
    )
    args = parser.parse_args(argv)
    options = {
        k: v
        for k, v in (("tokenizer", args.tokenizer), ("lerobot_backbone", args.lerobot_backbone))
        if v is not None
    }
    label, out = convert_export(
        args.export_dir, args.out_dir, dataset=args.dataset, fmt=args.format, **options
    )
    print(f"wrote a {label} policy to {out}")


if __name__ == "__main__":
    main()
