"""``longboat-diffusion data``: ``prepare`` a latent dataset, ``inspect`` one.

``prepare key=value ...`` encodes videos / images and captions with a Wan VAE and a UMT5 text
encoder, or with a FLUX pipeline's VAE, T5 and CLIP (the keys of
:class:`~longboat.diffusion.data.schema.PrepareConfig`, listed by ``prepare --help``), e.g.::

    longboat-diffusion data prepare input=clips/ out=data/latents model_dir=Wan2.1-T2V-1.3B-Diffusers \\
        height=480 width=832 num_frames=49 fps=16

``inspect <dir>``: counts, shapes, bytes and a few captions of a prepared dataset.

``tiny-pipeline <family> <dir>``: a tiny random diffusers pipeline of ``wan`` or ``flux``
(VAE, text encoder(s), tokenizer(s), scheduler, the family's tiny transformer) for trying
``prepare``, ``train model.init_from=<dir>`` and the exported pipeline on a CPU.

Bad input exits with 2 and one message naming the key or file at fault.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

__all__ = ["build_data_parser", "data_main", "parse_prepare_config"]

_PROG = "longboat-diffusion data"


def _field_docs() -> str:
    import inspect as _inspect

    from longboat.diffusion.data.schema import PrepareConfig

    src = _inspect.getsource(PrepareConfig)
    docs: dict[str, str] = {}
    tree = ast.parse(src).body[0]
    body = tree.body if isinstance(tree, ast.ClassDef) else []
    # A field's docstring is the string statement right after it.
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    lines = ["keys (key=value):"]
    for f in fields(PrepareConfig):
        default = "required" if f.name in ("input", "out") else f"default {_default(f)!r}"
        lines.append(f"  {f.name} ({default}): {docs.get(f.name, '')}")
    return "\n".join(lines)


def _default(f: Any) -> Any:
    from dataclasses import MISSING as DC_MISSING

    if f.default is not DC_MISSING:
        return f.default
    if f.default_factory is not DC_MISSING:
        return f.default_factory()
    return None


def build_data_parser() -> argparse.ArgumentParser:
    """The ``data`` command's parser."""
    parser = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="data_command", required=True)
    p = sub.add_parser(
        "prepare",
        help="encode videos / images + captions into a latent dataset (resumable)",
        epilog=_field_docs(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("overrides", nargs="*", help="key=value settings (below)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    i = sub.add_parser("inspect", help="counts, shapes, bytes and captions of a latent dataset")
    i.add_argument("path", type=Path, help="dataset directory (with manifest.json)")
    i.add_argument("--captions", type=int, default=3, help="captions to show")
    i.add_argument("--verify", action="store_true", help="check checksums and read every sample")
    from longboat.diffusion.tiny_pipelines import TINY_PIPELINE_FAMILIES

    t = sub.add_parser(
        "tiny-pipeline", help="write a tiny random diffusers pipeline (CPU trials of the path)"
    )
    t.add_argument("family", choices=TINY_PIPELINE_FAMILIES, help="the pipeline's family")
    t.add_argument("out", type=Path, help="directory to write")
    t.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    return parser


def parse_prepare_config(overrides: Sequence[str]) -> Any:
    """``key=value`` strings -> a validated ``PrepareConfig``; one ``ConfigError`` naming every
    unknown key, bad value or missing key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from longboat.core.config.errors import ConfigError, ProblemCollector
    from longboat.core.config.typecheck import merge_checked, missing_keys
    from longboat.diffusion.data.schema import PrepareConfig

    problems = ProblemCollector()
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    for o in bad:
        problems.add(None, "not a key=value setting", value=o, fix="write e.g. input=videos/")
    try:
        given = OmegaConf.to_container(
            OmegaConf.from_dotlist([o for o in overrides if o not in bad])
        )
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse the settings ({exc})") from None
    node = OmegaConf.structured(PrepareConfig)
    merge_checked(node, given, problems, set())
    for key in missing_keys(node):
        problems.add(key, "is required", fix=f"{key}=<path>")
    problems.raise_if_any()
    cfg = OmegaConf.to_object(node)
    cfg.validate()
    return cfg


def data_main(argv: Sequence[str] | None = None) -> int:
    """Run ``longboat-diffusion data <argv>``; 2 with one message on bad input."""
    from longboat.core.errors import UserError

    args = build_data_parser().parse_args(argv)
    try:
        if args.data_command == "prepare":
            from longboat.diffusion.data.prepare import prepare_latents

            cfg = parse_prepare_config(args.overrides)
            report = prepare_latents(cfg, progress=not args.no_progress and sys.stderr.isatty())
            print("\n".join(report.lines()))
            return 0
        if args.data_command == "tiny-pipeline":
            from longboat.diffusion.tiny_pipelines import build_tiny_pipeline

            out = build_tiny_pipeline(args.family, args.out, seed=args.seed)
            print(f"Tiny random {args.family} pipeline: {out}")
            return 0
        from longboat.diffusion.data.inspection import inspect_dataset

        print(inspect_dataset(args.path, captions=args.captions, verify=args.verify))
        return 0
    except UserError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
