"""The ``longboat`` command and the plumbing every stack's console script reuses.

``longboat stacks`` lists installed stacks; ``longboat config show <experiment>
[key=value ...]`` prints the resolved config; ``longboat demo`` runs core's small
end-to-end experiment. A stack's own command is one line::

    def main(argv=None) -> int:
        return stack_main("llm", argv, train=run_pretrain)

which gives ``longboat-llm train <experiment> [key=value ...]`` (``--cfg job`` prints the
resolved config instead, ``-m`` runs a sweep one job after another, ``--debug`` shows
tracebacks), ``longboat-llm config show ...`` and ``longboat-llm config list``. A problem
the user can fix (``longboat.core.errors.UserError``: bad config, a damaged checkpoint, a
broken dataset) prints one message on rank 0 and exits with its code (2 for bad input),
never a traceback; warnings print as they happen, each once.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.errors import RankFailure, UserError

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
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error instead of its message"
    )


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cfg",
        choices=("job", "hydra", "all"),
        default=None,
        help="print the resolved config (job) and exit instead of training",
    )
    parser.add_argument(
        "-m",
        "--multirun",
        action="store_true",
        help="run one job per combination of swept values (key=a,b), one after another",
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
    multirun: bool = False,
    print_config: str | None = None,
) -> int:
    """Compose + validate ``experiment`` (before any heavy init), then call ``fn(cfg)``.

    Returns ``fn``'s result when it is an int (an exit code), its ``exit_code`` attribute
    when it has one (a ``RunResult``), else 0. ``multirun``: one call per sweep job (in its
    own run directory), stopping at the first job that fails. ``print_config="job"``:
    print the resolved config(s) instead of calling ``fn``.
    """
    from omegaconf import OmegaConf

    from longboat.core.config.compose import compose_experiment

    if print_config not in (None, "job"):
        raise ConfigError(
            "longboat manages Hydra's own settings; only the job config can be printed",
            key="--cfg",
            value=print_config,
            fix="use --cfg job (or `config show <experiment>`)",
        )
    jobs = _sweep_jobs(experiment, overrides, stack, world_size) if multirun else None
    configs = (
        [(None, compose_experiment(experiment, overrides, stack=stack, world_size=world_size))]
        if jobs is None
        else jobs
    )
    code = 0
    for job, cfg in configs:
        if job is not None:
            print(f"== sweep job {job.index + 1}/{len(configs)}: {' '.join(job.swept)} "
                  f"(output_dir={cfg.output_dir})", flush=True)  # fmt: skip
        if print_config == "job":
            sys.stdout.write(OmegaConf.to_yaml(cfg, resolve=True))
            continue
        result = fn(cfg)
        code = _exit_code(result)
        if code != 0:
            break
    return code


def _exit_code(result: Any) -> int:
    if isinstance(result, int) and not isinstance(result, bool):
        return result
    code = getattr(result, "exit_code", 0)
    return code if isinstance(code, int) else 0


def _sweep_jobs(
    experiment: str, overrides: Sequence[str], stack: str | None, world_size: int | None
) -> list[tuple[Any, Any]]:
    """Each sweep job with its composed config, in its own ``<output_dir>/multirun/<job>``."""
    from omegaconf import OmegaConf

    from longboat.core.config.compose import compose_experiment
    from longboat.core.config.sweep import expand_sweep

    out = []
    for job in expand_sweep(overrides):
        base = compose_experiment(
            experiment, job.overrides, stack=stack, world_size=world_size, validate=False
        ).output_dir
        run_dir = f"{base}/multirun/{job.name}"
        cfg = compose_experiment(
            experiment,
            [*job.overrides, f"output_dir={run_dir}"],
            stack=stack,
            world_size=world_size,
        )
        out.append((job, cfg))
    for key in ("checkpoint.dir", "logging.dir"):
        seen: dict[str, int] = {}
        for job, cfg in out:
            value = str(OmegaConf.select(cfg, key))
            if value in seen:
                raise ConfigError(
                    f"sweep jobs {seen[value] + 1} and {job.index + 1} would share it",
                    key=key,
                    value=value,
                    fix=f"let {key} follow output_dir (drop its override), or sweep it too",
                )
            seen[value] = job.index
    return out


def _models(only: str | None) -> int:
    """``model=<option>``, family and flavor of each model of the installed stacks."""
    from longboat.core.stack import discover_stacks

    for name, stack in discover_stacks().items():
        if only is not None and name != only:
            continue
        rows = stack.models()
        if not rows:
            continue
        print(f"{name}:")
        width = max(len(option) for option, _, _ in rows) + len("model=")
        for option, family, flavor in rows:
            print(f"  {'model=' + option:<{width}}  {family} {flavor}")
    return 0


def _version_text(only: str | None = None) -> str:
    """Versions of longboat's installed distributions (``only``: that stack's and core's)."""
    import importlib.metadata as md

    from longboat.core.stack import discover_stacks

    names = ["longboat-core"]
    for name, stack in discover_stacks().items():
        if stack.distribution and stack.distribution not in names and only in (None, name):
            names.append(stack.distribution)
    parts = []
    for dist in names:
        try:
            parts.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            parts.append(f"{dist} (not installed as a distribution)")
    return ", ".join(parts)


class _Version(argparse.Action):
    """``--version``: resolved when used (discovering stacks is not free)."""

    def __init__(self, option_strings: Any, dest: str, only: str | None = None, **kw: Any):
        super().__init__(option_strings, dest, nargs=0, help="print the installed versions", **kw)
        self.only = only

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        print(_version_text(self.only))
        parser.exit()


def _examples(lines: Sequence[str]) -> str | None:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines) if lines else None


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

    return run_experiment(
        "demo",
        args.overrides,
        run,
        stack="core",
        world_size=args.world_size,
        multirun=args.multirun,
        print_config=args.cfg,
    )


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
        experiment,
        args.overrides,
        fn,
        stack=owner.name,
        world_size=args.world_size,
        multirun=args.multirun,
        print_config=args.cfg,
    )


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args that also takes overrides placed after options (``show x --world-size 2 a=b``)."""
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(a.startswith("-") for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _main_rank() -> bool:
    """True unless torchrun says this process is not global rank 0."""
    return os.environ.get("RANK", "0") in ("", "0")


@contextmanager
def _warnings_as_they_happen(prog: str) -> Iterator[None]:
    """Print each warning once, when it is raised, as ``prog: warning: message`` (rank 0)."""
    seen: set[str] = set()
    main = _main_rank()

    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        text = str(message)
        if text in seen or not main:
            return
        seen.add(text)
        print(f"{prog}: warning: {text}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        yield


def _dispatch(run: Callable[[], int], prog: str, *, debug: bool = False) -> int:
    """Run a command: warnings as they happen; a ``UserError`` as its message and exit code
    (the traceback with ``--debug``); Ctrl-C outside a training step as exit 130."""
    with _warnings_as_they_happen(prog):
        try:
            return run()
        except RankFailure as exc:
            # A peer failed: the lowest surviving rank names it. This rank then ends at once,
            # as tearing down a process group with a dead peer can block or abort.
            if exc.report:
                print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(exc.exit_code)
        except UserError as exc:
            if debug:
                raise
            if _main_rank():
                head = "" if isinstance(exc, ConfigError) else "error: "
                print(f"{prog}: {head}{exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        except KeyboardInterrupt:
            if debug:
                raise
            if _main_rank():
                print(f"{prog}: interrupted", file=sys.stderr, flush=True)
            return 130


def build_parser() -> argparse.ArgumentParser:
    """The ``longboat`` umbrella parser."""
    from longboat.core.stack import CORE_STACK

    parser = argparse.ArgumentParser(
        prog="longboat",
        description="longboat: train LLMs, VLMs, diffusion and VLA models.",
        epilog=_examples(CORE_STACK.examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("stacks", help="list the installed stacks")
    sub.add_parser("models", help="list the model families and flavors of the installed stacks")
    _add_config_commands(sub, with_stack=True)
    train = sub.add_parser("train", help="run an experiment with its stack's train function")
    _add_experiment_args(train, with_stack=True)
    _add_run_args(train)
    demo = sub.add_parser("demo", help="train core's small demo model end to end on CPU")
    demo.add_argument("overrides", nargs="*", help="overrides of the demo experiment")
    demo.add_argument("--world-size", type=int, default=None, help=argparse.SUPPRESS)
    demo.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    _add_run_args(demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``longboat`` console script."""
    args = _parse(build_parser(), argv)

    def run() -> int:
        if args.command == "stacks":
            return _stacks()
        if args.command == "models":
            return _models(None)
        if args.command == "config":
            if args.config_command == "list":
                return _config_list(None)
            return _config_show(args, args.stack)
        if args.command == "train":
            return _train(args, args.stack)
        return _demo(args)

    return _dispatch(run, "longboat", debug=getattr(args, "debug", False))


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
    parser = argparse.ArgumentParser(
        prog=prog,
        description=stack.description,
        epilog=_examples(stack.examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_Version, only=stack_name)
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser = sub.add_parser(
        "train",
        help=f"run a {stack_name} experiment",
        epilog=_examples(stack.examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_experiment_args(train_parser, with_stack=False)
    _add_run_args(train_parser)
    _add_config_commands(sub, with_stack=False)
    sub.add_parser("models", help=f"list the {stack_name} model families and flavors")
    for name, (help_text, _) in (commands or {}).items():
        sub.add_parser(name, help=help_text, add_help=False)  # listed in --help only
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and commands and argv[0] in commands:
        # Extra commands own their whole argv (their own flags, their own --help).
        handler = commands[argv[0]][1]
        return _dispatch(lambda: handler(argv[1:]), prog, debug="--debug" in argv)
    args = _parse(parser, argv)

    def run() -> int:
        if args.command == "train":
            return _train(args, stack_name, train)
        if args.command == "models":
            return _models(stack_name)
        if args.command == "config":
            if args.config_command == "list":
                return _config_list(stack_name)
            return _config_show(args, stack_name)
        raise AssertionError(f"unhandled command {args.command!r}")  # argparse restricts choices

    return _dispatch(run, prog, debug=getattr(args, "debug", False))


__all__ = ["EXIT_CONFIG_ERROR", "build_parser", "main", "run_experiment", "stack_main"]
