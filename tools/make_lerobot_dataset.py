"""Write a synthetic LeRobot dataset (v2.1 or v3.0) for tests, quickstarts and benchmarks.

Thin CLI over ``longboat.embodied.data.write_synthetic_dataset``; values are closed-form
functions of (episode, frame), see ``longboat.embodied.data.synthetic``.

    python tools/make_lerobot_dataset.py /tmp/ds --layout v3.0 --episodes 8 \
        --length 20 40 --fps 10 --cameras front wrist --size 84 56 \
        --embodiment arm6:6:5 --embodiment biarm:14:14 --task "pick the cube"
"""

from __future__ import annotations

import argparse
import sys

from longboat.embodied.data import EmbodimentSpec, LeRobotMetadata, write_synthetic_dataset


def _embodiment(text: str) -> EmbodimentSpec:
    try:
        name, state_dim, action_dim = text.split(":")
        return EmbodimentSpec(name=name, state_dim=int(state_dim), action_dim=int(action_dim))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--embodiment {text!r}: expected NAME:STATE_DIM:ACTION_DIM, e.g. arm6:6:5"
        ) from None


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, write the dataset(s), print one summary line per dataset root."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="output directory (one sub-directory per embodiment if several)")
    p.add_argument("--layout", choices=["v2.1", "v3.0"], default="v3.0")
    p.add_argument("--episodes", type=int, default=3, help="episodes per embodiment")
    p.add_argument("--length", type=int, nargs=2, default=[20, 20], metavar=("MIN", "MAX"))
    p.add_argument("--fps", type=int, default=10)
    p.add_argument("--cameras", nargs="*", default=["front", "wrist"])
    p.add_argument("--size", type=int, nargs=2, default=[24, 32], metavar=("HEIGHT", "WIDTH"))
    p.add_argument("--embodiment", type=_embodiment, action="append", default=None)
    p.add_argument("--task", action="append", default=None, help="task string (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--crf", type=int, default=12)
    p.add_argument("--gop", type=int, default=8)
    p.add_argument("--episodes-per-file", type=int, default=None, help="v3.0 only")
    args = p.parse_args(argv)
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
            f"{meta.info['total_frames']} frames, {len(meta.tasks)} tasks, cameras {meta.video_keys}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
