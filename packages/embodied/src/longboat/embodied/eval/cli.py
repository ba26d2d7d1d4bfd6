"""``longboat-embodied eval``: roll a trained policy out in a simulated suite.

    longboat-embodied eval runs/pusht/export --suite pusht --episodes 50 --num-envs 8 \\
        --seed 0 --videos 3 --out runs/pusht/eval

    longboat-embodied eval checkpoint=runs/pusht --suite pusht --episodes 50

POLICY is an export folder (``<output_dir>/export``, or its ``lerobot/`` / ``isaac/``
folder) or a run directory (its export); ``checkpoint=PATH`` a run's native checkpoint (a
run directory: its newest; its ``checkpoint.dir``; or a ``step_XXXXXXXX`` folder), the
policy rebuilt from the run's stored config and its dataset's statistics. Writes ``results.json``, ``results.md`` (success rate per task
and for the suite, with a Wilson 95% interval) and ``videos/*.mp4`` into --out, and prints
the table. The same arguments give the same episodes and the same results.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

PROG = "longboat-embodied eval"


def _camera(text: str) -> tuple[str, str]:
    policy_key, sep, suite_key = text.partition("=")
    if not sep or not policy_key or not suite_key:
        raise argparse.ArgumentTypeError(
            f"--camera {text!r}: expected POLICY_KEY=SUITE_KEY, e.g. "
            "observation.images.front=observation.images.top"
        )
    return policy_key, suite_key


def build_parser() -> argparse.ArgumentParser:
    """The ``longboat-embodied eval`` parser."""
    from longboat.embodied.eval.suite import suite_names

    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "policy", help="export folder, run directory, or checkpoint=PATH (a native checkpoint)"
    )
    parser.add_argument(
        "--suite",
        required=True,
        help=f"built-in suite ({', '.join(suite_names())}) or the path of a suite .yaml",
    )
    parser.add_argument("--task", action="append", default=None, help="only this task (repeatable)")
    parser.add_argument("--episodes", type=int, default=10, help="episodes per task")
    parser.add_argument("--num-envs", type=int, default=1, help="environments stepped together")
    parser.add_argument("--seed", type=int, default=0, help="episode k resets with seed + k")
    parser.add_argument("--max-steps", type=int, default=None, help="default: the suite's")
    parser.add_argument("--videos", type=int, default=2, help="episodes recorded per task")
    parser.add_argument("--out", default="eval", help="output folder")
    parser.add_argument("--device", default="cpu", help="the policy's device (cpu, cuda, ...)")
    parser.add_argument("--n-action-steps", type=int, default=None, help="actions per chunk")
    parser.add_argument(
        "--processes", action="store_true", help="one process per environment (AsyncVectorEnv)"
    )
    parser.add_argument(
        "--camera", type=_camera, action="append", default=[], metavar="POLICY_KEY=SUITE_KEY"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def eval_main(argv: Sequence[str] | None = None) -> int:
    """``longboat-embodied eval <argv>``; a ConfigError exits 2 (core's command dispatch)."""
    args = build_parser().parse_args(argv)
    from longboat.embodied.eval.runner import evaluate, load_acting_policy, remap_cameras
    from longboat.embodied.eval.suite import check_installed, load_suite

    suite = load_suite(args.suite, key="--suite")
    check_installed(suite, key="--suite")
    suite = remap_cameras(suite, dict(args.camera))
    for task in args.task or []:
        suite.task(task)  # an unknown task fails before the policy loads
    policy = load_acting_policy(
        args.policy, suite, device=args.device, n_action_steps=args.n_action_steps
    )
    results = evaluate(
        suite,
        policy,
        args.out,
        episodes=args.episodes,
        num_envs=args.num_envs,
        seed=args.seed,
        max_steps=args.max_steps,
        videos=args.videos,
        tasks=args.task,
        processes=args.processes,
        progress=not args.no_progress,
        policy_name=str(args.policy),
    )
    from longboat.embodied.eval.report import RESULTS_JSON, markdown_table

    print(markdown_table(results), end="")
    total = results["total"]
    print(
        f"{total['successes']}/{total['episodes']} episodes succeeded in "
        f"{results['wall_s']:.1f}s; results: {args.out}/{RESULTS_JSON}"
    )
    return 0
