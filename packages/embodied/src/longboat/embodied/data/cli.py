"""``longboat-embodied data make-synthetic``: write a synthetic LeRobot dataset (v2.1 or
v3.0) to try a policy, test a pipeline or benchmark, through ``write_synthetic_dataset``
(values are closed-form functions of episode and frame, ``longboat.embodied.data.synthetic``).

    longboat-embodied data make-synthetic /tmp/ds --layout v3.0 --episodes 8 \\
        --length 20 40 --fps 10 --cameras front wrist --size 84 56 \\
        --embodiment arm6:6:5 --embodiment biarm:14:14 --task "pick the cube"
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from longboat.embodied.data.synthetic import EmbodimentSpec

PROG = "longboat-embodied data"


def _embodiment(text: str) -> EmbodimentSpec:
    from longboat.embodied.data.synthetic import EmbodimentSpec

    try:
        name, state_dim, action_dim = text.split(":")
        return EmbodimentSpec(name=name, state_dim=int(state_dim), action_dim=int(action_dim))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--embodiment {text!r}: expected NAME:STATE_DIM:ACTION_DIM, e.g. arm6:6:5"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``longboat-embodied data`` parser (sub-command ``make-synthetic``)."""
    parser = argparse.ArgumentParser(prog=PROG, description="LeRobot dataset tools.")
    sub = parser.add_subparsers(dest="data_command", required=True)
    p = sub.add_parser(
        "make-synthetic",
        help="write a synthetic LeRobot dataset",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", help="output directory (one sub-directory per embodiment if several)")
    p.add_argument("--layout", choices=["v2.1", "v3.0"], default="v3.0")
    p.add_argument("--episodes", type=int, default=3, help="episodes per embodiment")
    p.add_argument("--length", type=int, nargs=2, default=[20, 20], metavar=("MIN", "MAX"))
    p.add_argument("--fps", type=int, default=10)
    p.add_argument(
        "--cameras",
        nargs="+",
        default=["front", "wrist"],
        help="camera names (top) or keys (observation.images.top); both give the key "
        "observation.images.top",
    )
    p.add_argument("--size", type=int, nargs=2, default=[24, 32], metavar=("HEIGHT", "WIDTH"))
    p.add_argument(
        "--embodiment",
        type=_embodiment,
        action="append",
        default=None,
        help="NAME:STATE_DIM:ACTION_DIM (repeatable; default arm6:6:5)",
    )
    p.add_argument("--task", action="append", default=None, help="task string (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--crf", type=int, default=12, help="video quality (lower: closer frames)")
    p.add_argument("--gop", type=int, default=8, help="video keyframe interval")
    p.add_argument("--episodes-per-file", type=int, default=None, help="v3.0 only")
    return parser


def make_synthetic(args: argparse.Namespace) -> int:
    """Write the dataset(s) of parsed ``make-synthetic`` arguments; print one line per root."""
    from longboat.embodied.data import LeRobotMetadata, write_synthetic_dataset

    kwargs = {}
    if args.embodiment:
        kwargs["embodiments"] = tuple(args.embodiment)
    if args.task:
        kwargs["tasks"] = tuple(args.task)
    roots = write_synthetic_dataset(
        args.root,
        layout=args.layout,
        num_episodes=args.episodes,
        episode_length=tuple(args.length),
        fps=args.fps,
        cameras=tuple(args.cameras),
        image_size=tuple(args.size),
        seed=args.seed,
        crf=args.crf,
        gop=args.gop,
        episodes_per_file=args.episodes_per_file,
        **kwargs,
    )
    for root in roots:
        meta = LeRobotMetadata.load(root)
        print(
            f"{root}: LeRobot {meta.version}, {len(meta.episodes)} episodes, "
            f"{meta.info['total_frames']} frames, {len(meta.tasks)} tasks, cameras "
            f"{meta.video_keys}"
        )
    return 0


def data_main(argv: Sequence[str] | None = None) -> int:
    """``longboat-embodied data <argv>``; bad values exit 2 with one message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return make_synthetic(args)
    except ValueError as exc:  # write_synthetic_dataset's checks of the values given
        parser.exit(2, f"{PROG} {args.data_command}: error: {exc}\n")
