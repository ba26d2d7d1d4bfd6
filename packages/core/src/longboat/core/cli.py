"""The ``longboat`` command and the plumbing every stack's console script reuses.

``longboat stacks`` lists installed stacks; ``longboat config show <experiment>
[key=value ...]`` prints the resolved config; ``longboat demo`` runs core's small
end-to-end experiment. A stack's own command is one line::

    def main(argv=None) -> int:
        return stack_main("llm", argv, train=run_pretrain)

which gives ``longboat-llm train <experiment> [key=value ...]``,
``longboat-llm config show ...`` and ``longboat-llm config list``. Bad config ->
the ConfigError text on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from longboat.core.config.errors import ConfigError

EXIT_CONFIG_ERROR = 2
"""Exit code for invalid configuration or command-line input (argparse uses 2 too)."""

Command = tuple[str, Callable[[list[str]], int]]
"""An extra stack subcommand: (help line, handler taking the remaining argv, returning exit code)."""


def _add_experiment_args(parser: argparse.ArgumentParser, with_stack: bool) -> None:
    parser.add_argument(
        "experiment", help="experiment name (a file under experiment/); experiment=NAME works too"
    )
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides: key=value, group=option, +key=value, ~key"
    )
    if with_stack:
        parser.add_argument("--stack", help="stack that owns the experiment, when ambiguous")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="check the parallel layout against this many processes (default: $WORLD_SIZE)",
    )


def _experiment(args: argparse.Namespace) -> str:
    """The experiment name; ``experiment=NAME`` (Hydra style) is accepted too."""
    name: str = args.experiment
    return name.removeprefix("experiment=").removeprefix("+experiment=")


def _add_config_commands(sub: Any, with_stack: bool) -> None:
    config = sub.add_parser("config", help="inspect experiment configs")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved, validated config as YAML")
    _add_experiment_args(show, with_stack)
    show.add_argument(
        "--no-validate", action="store_true", help="skip cross-field checks (types still checked)"
    )
    config_sub.add_parser("list", help="list the experiments of the installed stacks")


def _config_show(args: argparse.Namespace, stack: str | None) -> int:
    from omegaconf import OmegaConf

    from longboat.core.config.compose import compose_experiment

    cfg = compose_experiment(
        _experiment(args),
        args.overrides,
        stack=stack,
        world_size=args.world_size,
        validate=not args.no_validate,
    )
    sys.stdout.write(OmegaConf.to_yaml(cfg, resolve=True))
    return 0


def _config_list(only: str | None) -> int:
    from longboat.core.config.compose import list_experiments

    for name, experiments in list_experiments().items():
        if only is not None and name != only:
            continue
        print(f"{name}: {', '.join(experiments) if experiments else '(no experiments)'}")
    return 0


def run_experiment(
    experiment: str,
    overrides: Sequence[str],
    fn: Callable[[Any], Any],
    *,
    stack: str | None = None,
    world_size: int | None = None,
) -> int:
    """Compose + validate ``experiment`` (before any heavy init), then call ``fn(cfg)``.

    Returns ``fn``'s result when it is an int (an exit code), else 0.
    """
    from longboat.core.config.compose import compose_experiment

    cfg = compose_experiment(experiment, overrides, stack=stack, world_size=world_size)
    result = fn(cfg)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _stacks() -> int:
    from longboat.core.stack import discover_stacks

    stacks = discover_stacks()
    width = max(len(name) for name in stacks)
    for name, stack in stacks.items():
        script = f"  [{stack.console_script}]" if stack.console_script else ""
        print(f"{name:<{width}}  {stack.description}{script}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("longboat.core.demo") is None:
        print(
            "longboat demo: the core demo (longboat.core.demo) is not part of this install "
            "yet; run `longboat stacks` to see what is installed.",
            file=sys.stderr,
        )
        return 1
    from longboat.core.demo import run  # lazy: pulls in torch

    return run_experiment("demo", args.overrides, run, stack="core", world_size=args.world_size)


def _train(args: argparse.Namespace, stack_name: str | None, train: Any = None) -> int:
    from longboat.core.config.compose import find_experiment_stack

    experiment = _experiment(args)
    owner = find_experiment_stack(experiment, stack_name)
    fn = train if train is not None else owner.resolve_train()
    if fn is None:
        raise ConfigError(
            f"stack {owner.name!r} has no train function",
            key="stack",
            value=owner.name,
            fix="use the stack's own console script, or set Stack.train",
        )
    return run_experiment(
        experiment, args.overrides, fn, stack=owner.name, world_size=args.world_size
    )


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args that also takes overrides placed after options (``show x --world-size 2 a=b``)."""
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(a.startswith("-") for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _dispatch(run: Callable[[], int], prog: str) -> int:
    # Warnings (a stack that failed to load, an unchecked model schema) become one
    # short stderr line each instead of Python's two-line source dump.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        error: ConfigError | None = None
        try:
            code = run()
        except ConfigError as exc:
            error, code = exc, EXIT_CONFIG_ERROR
        finally:
            for w in caught:
                print(f"{prog}: warning: {w.message}", file=sys.stderr)
    if error is not None:
        print(f"{prog}: {error}", file=sys.stderr)
    return code


def build_parser() -> argparse.ArgumentParser:
    """The ``longboat`` umbrella parser."""
    parser = argparse.ArgumentParser(
        prog="longboat", description="longboat: train LLMs, VLMs, diffusion and VLA models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("stacks", help="list the installed stacks")
    _add_config_commands(sub, with_stack=True)
    train = sub.add_parser("train", help="run an experiment with its stack's train function")
    _add_experiment_args(train, with_stack=True)
    demo = sub.add_parser("demo", help="train core's small demo model end to end on CPU")
    demo.add_argument("overrides", nargs="*", help="overrides of the demo experiment")
    demo.add_argument("--world-size", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``longboat`` console script."""
    args = _parse(build_parser(), argv)

    def run() -> int:
        if args.command == "stacks":
            return _stacks()
        if args.command == "config":
            if args.config_command == "list":
                return _config_list(None)
            return _config_show(args, args.stack)
        if args.command == "train":
            return _train(args, args.stack)
        return _demo(args)

    return _dispatch(run, "longboat")


def stack_main(
    stack_name: str,
    argv: Sequence[str] | None = None,
    *,
    train: Callable[[Any], Any] | None = None,
    commands: Mapping[str, Command] | None = None,
    prog: str | None = None,
) -> int:
    """Console-script body for a stack: ``train``, ``config show|list`` and extra commands.

    ``train`` receives the composed, validated config (default: the stack's
    ``Stack.train``). ``commands`` adds subcommands (``convert``, ``data``, ``bench``)
    whose handlers get the remaining argv and return an exit code.
    """
    from longboat.core.stack import get_stack

    found: list[Any] = []
    code = _dispatch(
        lambda: found.append(get_stack(stack_name)) or 0, prog or f"longboat-{stack_name}"
    )
    if not found:
        return code
    stack = found[0]
    prog = prog or stack.console_script or f"longboat-{stack_name}"
    parser = argparse.ArgumentParser(prog=prog, description=stack.description)
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser = sub.add_parser("train", help=f"run a {stack_name} experiment")
    _add_experiment_args(train_parser, with_stack=False)
    _add_config_commands(sub, with_stack=False)
    for name, (help_text, _) in (commands or {}).items():
        sub.add_parser(name, help=help_text, add_help=False)  # listed in --help only
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and commands and argv[0] in commands:
        # Extra commands own their whole argv (their own flags, their own --help).
        handler = commands[argv[0]][1]
        return _dispatch(lambda: handler(argv[1:]), prog)
    args = _parse(parser, argv)

    def run() -> int:
        if args.command == "train":
            return _train(args, stack_name, train)
        if args.command == "config":
            if args.config_command == "list":
                return _config_list(stack_name)
            return _config_show(args, stack_name)
        raise AssertionError(f"unhandled command {args.command!r}")  # argparse restricts choices

    return _dispatch(run, prog)


__all__ = ["EXIT_CONFIG_ERROR", "build_parser", "main", "run_experiment", "stack_main"]
