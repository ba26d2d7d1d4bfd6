"""Compose an experiment config from every installed stack's config groups.

Hydra's compose API builds the config from the groups (``model``, ``data``,
``parallel``, ``optim``, ``train``, ``checkpoint``, ``logging``, ``experiment``)
found on a search path made of each installed stack's config directory (the
experiment's own stack first, so its options win name clashes). Group choices
(``model=mlp``) go through Hydra; plain key overrides (``optim.lr=1e-3``) are
applied afterwards, so keys the YAML does not spell out can still be set.
The result is merged key by key onto the typed schema (the stack's root
dataclass, with ``model``/``data`` swapped for the dataclass registered for
``model.name``/``data.name``) and validated; every problem found lands in one
``ConfigError``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from longboat.core.config.errors import ConfigError, ProblemCollector
from longboat.core.config.renamed import CORE_RENAMED_KEYS, take_renamed_keys
from longboat.core.config.schema import ExperimentConfig
from longboat.core.config.suggest import close_matches, did_you_mean
from longboat.core.config.typecheck import merge_checked, missing_keys, to_plain, unresolvable
from longboat.core.family import family_conf_dirs
from longboat.core.stack import Stack, discover_stacks, get_stack, resolve_ref

GROUPS = ("model", "data", "parallel", "optim", "train", "checkpoint", "logging", "experiment")
"""The config groups every stack may contribute options to."""

PRIMARY_CONFIG = "longboat"
"""Name of the primary config (``conf/longboat.yaml`` in core) that lists the group defaults."""

_PRIMARY_NODE = "_longboat_primary"
"""Name under which the primary config is stored in Hydra's ConfigStore (see ``_store_primary``)."""


def _conf_dirs(owner: Stack, stacks: Mapping[str, Stack]) -> list[Path]:
    ordered = [owner] + [s for s in stacks.values() if s is not owner]
    dirs = []
    for stack in ordered:
        path = stack.conf_path()
        if path is not None and path.is_dir() and path not in dirs:
            dirs.append(path)
    # After the stacks' own: a family folder adds options, it does not replace them.
    dirs += [d for d in family_conf_dirs() if d not in dirs]
    return dirs


def known_groups(dirs: Sequence[Path]) -> set[str]:
    """Every config group (``model``, ``model/llm`` ...) present in any of ``dirs``."""
    groups = set(GROUPS)
    for conf in dirs:
        for sub in conf.rglob("*"):
            if sub.is_dir() and not sub.name.startswith(("_", ".")):
                groups.add(sub.relative_to(conf).as_posix())
    return groups


def group_options(group: str, dirs: Sequence[Path]) -> list[str]:
    """Option names of ``group`` over all ``dirs``."""
    names = set()
    for conf in dirs:
        if (conf / group).is_dir():
            names.update(p.stem for p in (conf / group).glob("*.yaml"))
    return sorted(names)


def list_experiments(stacks: Mapping[str, Stack] | None = None) -> dict[str, list[str]]:
    """Experiment names per installed stack."""
    stacks = discover_stacks() if stacks is None else stacks
    return {name: stack.experiments() for name, stack in stacks.items()}


def find_experiment_stack(
    experiment: str, stack: str | None = None, stacks: Mapping[str, Stack] | None = None
) -> Stack:
    """The stack that owns ``experiment`` (``stack`` when given); ConfigError with a did-you-mean."""
    stacks = discover_stacks() if stacks is None else stacks
    if stack is not None:
        owner = get_stack(stack, stacks)
        if experiment not in owner.experiments():
            raise ConfigError(
                f"stack {owner.name!r} has no such experiment",
                key="experiment",
                value=experiment,
                fix=did_you_mean(experiment, owner.experiments(), what=f"{owner.name} experiments"),
            )
        return owner
    owners = [s for s in stacks.values() if experiment in s.experiments()]
    if len(owners) == 1:
        return owners[0]
    if not owners:
        every = sorted({e for s in stacks.values() for e in s.experiments()})
        raise ConfigError(
            "no installed stack has this experiment",
            key="experiment",
            value=experiment,
            fix=did_you_mean(experiment, every, what="installed experiments"),
        )
    names = ", ".join(s.name for s in owners)
    raise ConfigError(
        f"experiment is defined by several stacks ({names})",
        key="experiment",
        value=experiment,
        fix=f"pick one with stack=<name> (--stack on the command line): {names}",
    )


def _quote(path: Path) -> str:
    text = path.resolve().as_posix().replace("\\", "\\\\").replace("'", "\\'")
    return f"'file://{text}'"


def _split_overrides(
    overrides: Sequence[str], dirs: Sequence[Path], problems: ProblemCollector
) -> tuple[list[str], list[Any]]:
    """(group overrides for Hydra as text, parsed key overrides to apply afterwards)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    groups = known_groups(dirs)
    group_texts: list[str] = []
    key_overrides: list[Any] = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as exc:
            problems.add(
                None,
                f"cannot parse override: {str(exc).splitlines()[0]}",
                value=text,
                fix="write overrides as key=value, +key=value, ~key or group=option",
            )
            continue
        name = override.key_or_group
        if not name:
            problems.add(None, "override has no key", value=text, fix="write key=value")
            continue
        if override.is_sweep_override():
            problems.add(
                name,
                f"is a sweep ({text})",
                fix="add -m (--multirun) to run one job per value, or pass a single value",
            )
            continue
        if name == "experiment" or name.startswith("hydra"):
            problems.add(
                name,
                "cannot be overridden",
                value=text,
                fix="the experiment is the positional argument; hydra.* is managed by longboat",
            )
            continue
        value = None if override.is_delete() else override.value()
        if name in groups and (value is None or isinstance(value, str)):
            if value is not None and value not in group_options(name, dirs):
                problems.add(
                    name,
                    "no such option in this config group",
                    value=value,
                    fix=did_you_mean(value, group_options(name, dirs), what=f"{name} options"),
                )
                continue
            group_texts.append(override.input_line)
        else:
            key_overrides.append(override)
    return group_texts, key_overrides


def _apply_key_overrides(
    composed: dict[str, Any], key_overrides: Sequence[Any], problems: ProblemCollector
) -> dict[str, Any]:
    cfg = OmegaConf.create(composed)
    OmegaConf.set_struct(cfg, False)
    for override in key_overrides:
        key = override.key_or_group
        try:
            if override.is_delete():
                parent_key, _, leaf = key.rpartition(".")
                parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
                if not isinstance(parent, DictConfig) or leaf not in parent:
                    problems.add(key, "cannot delete a key the composed config does not set")
                    continue
                del parent[leaf]
            else:
                OmegaConf.update(cfg, key, override.value(), merge=True, force_add=True)
        except OmegaConfBaseException as exc:
            problems.add(key, f"cannot apply override: {exc.msg}", value=override.input_line)
    return to_plain(cfg)


def _store_primary(dirs: Sequence[Path]) -> str:
    """Put the primary config into Hydra's ConfigStore and return its name.

    Hydra looks the primary config up before it applies ``hydra.searchpath`` (and
    caches the miss), so a primary that only sits in a searchpath dir is never
    found. The ConfigStore is always on the initial search path; the first stack
    dir that has ``longboat.yaml`` provides it (the owner's, else core's).
    """
    from hydra.core.config_store import ConfigStore

    for conf in dirs:
        path = conf / f"{PRIMARY_CONFIG}.yaml"
        if path.is_file():
            node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            ConfigStore.instance().store(name=_PRIMARY_NODE, node=node)
            return _PRIMARY_NODE
    raise ConfigError(
        f"no installed stack provides the primary config {PRIMARY_CONFIG}.yaml",
        fix="reinstall longboat-core (its conf/ directory is missing)",
    )


def _compose_with_hydra(
    experiment: str, group_overrides: list[str], dirs: Sequence[Path]
) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    search = "hydra.searchpath=[" + ",".join(_quote(d) for d in dirs[1:]) + "]"
    primary = _store_primary(dirs)
    try:
        with initialize_config_dir(
            config_dir=str(dirs[0].resolve()), version_base="1.3", job_name="longboat"
        ):
            cfg = compose(
                config_name=primary,
                overrides=[*group_overrides, f"+experiment={experiment}", search],
            )
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(
            f"Hydra could not compose the config: {exc}",
            key="experiment",
            value=experiment,
            fix="check the YAML files and defaults lists named above",
        ) from None
    return to_plain(cfg)


def _lookup_schema(kind: str, name: Any, owner: Stack, stacks: Mapping[str, Stack]) -> Any:
    if not isinstance(name, str):
        return None
    for stack in [owner] + [s for s in stacks.values() if s is not owner]:
        try:
            schema = stack.model_schema(name) if kind == "model" else stack.data_schema(name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"stack {stack.name!r} registers a {kind} schema for {name!r} that cannot be "
                f"imported: {exc}",
                key=f"{kind}.name",
                value=name,
                fix=f"fix the {kind}_schemas entry of stack {stack.name!r} or reinstall it",
            ) from None
        if schema is not None:
            return schema
    return None


def _registered(kind: str, stacks: Mapping[str, Stack]) -> list[str]:
    from longboat.core.family import list_families

    names: set[str] = set()
    for stack in stacks.values():
        names.update(stack.model_schemas if kind == "model" else stack.data_schemas)
        if kind == "model":
            names.update(list_families(stack.name))
    return sorted(names)


def _typed_root(
    composed: dict[str, Any], owner: Stack, stacks: Mapping[str, Stack], problems: ProblemCollector
) -> DictConfig:
    typed = OmegaConf.structured(owner.resolve_root_schema())
    for kind in ("model", "data"):
        section = composed.get(kind)
        section = section if isinstance(section, Mapping) else {}
        name = section.get("name", OmegaConf.select(typed, f"{kind}.name", default=None))
        schema = _lookup_schema(kind, name, owner, stacks)
        if schema is not None:
            try:
                typed[kind] = OmegaConf.structured(schema)
            except OmegaConfBaseException as exc:
                problems.add(
                    f"{kind}.name",
                    f"the registered schema {schema.__name__} does not fit the root schema: "
                    f"{exc.msg}",
                    value=name,
                    fix=f"make {schema.__name__} subclass the type of {kind} in the root schema",
                )
        elif (
            "name" in section  # chosen by YAML or override, not the schema default
            and isinstance(name, str)
            and (guesses := close_matches(name, _registered(kind, stacks)))
        ):
            problems.add(
                f"{kind}.name",
                f"no installed stack registers a {kind} schema under this name",
                value=name,
                fix=did_you_mean(name, guesses, what=f"registered {kind} names"),
            )
        elif set(section) - set(typed[kind].keys()):
            # No schema registered: keep the base fields typed, accept the rest unchecked.
            warnings.warn(
                f"no stack registers a schema for {kind}.name={name!r}; {kind}.* keys other "
                "than the base fields are not checked",
                stacklevel=3,
            )
            OmegaConf.set_struct(typed[kind], False)
    return typed


def _flat(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _first_file(dirs: Sequence[Path], rel: str) -> Path | None:
    return next((d / rel for d in dirs if (d / rel).is_file()), None)


def _chosen_groups_win(
    composed: dict[str, Any], experiment: str, group_overrides: list[str], dirs: Sequence[Path]
) -> None:
    """A group option chosen on the command line (``model=qwen3_0_6b``) is used as it is: the
    experiment's own keys in that group, which Hydra would lay over it, are dropped (the
    option's value, or the schema default, applies) with a warning naming them."""
    exp_file = _first_file(dirs, f"experiment/{experiment}.yaml")
    if exp_file is None:
        return
    exp = OmegaConf.to_container(OmegaConf.load(exp_file), resolve=False)
    for text in group_overrides:
        group, _, option = text.lstrip("+").partition("=")
        section = exp.get(group) if isinstance(exp, dict) else None
        if "/" in group or not option or not isinstance(section, Mapping) or not section:
            continue
        opt_file = _first_file(dirs, f"{group}/{option}.yaml")
        chosen = _flat(OmegaConf.to_container(OmegaConf.load(opt_file))) if opt_file else {}
        target = composed.get(group)
        if not isinstance(target, dict):
            continue
        dropped = []
        for key in _flat(section):
            *parents, leaf = key.split(".")
            holder: Any = target
            for part in parents:
                holder = holder.get(part) if isinstance(holder, dict) else None
            if not isinstance(holder, dict) or leaf not in holder:
                continue
            if key in chosen:
                holder[leaf] = chosen[key]
            else:
                del holder[leaf]
            dropped.append(key)
        if dropped:
            warnings.warn(
                f"{group}={option} replaces the {group} settings of experiment {experiment} "
                f"({', '.join(f'{group}.{k}' for k in dropped)}): the command line's choice "
                f"wins; set {group}.<key>=<value> to change one of them",
                stacklevel=3,
            )


def _given_keys(group_overrides: list[str], key_overrides: Sequence[Any]) -> set[str]:
    """Every key and group the command line set (``model.hidden_size``, ``model``)."""
    given = {text.lstrip("+~").partition("=")[0] for text in group_overrides}
    given |= {o.key_or_group for o in key_overrides}
    return given


def compose_experiment(
    experiment: str,
    overrides: Sequence[str] = (),
    stack: str | None = None,
    *,
    world_size: int | None = None,
    validate: bool = True,
    stacks: Mapping[str, Stack] | None = None,
) -> DictConfig:
    """Compose, type-check and (by default) validate one experiment.

    ``experiment`` is a file name under some stack's ``experiment/`` group; ``stack``
    picks the owner when several stacks define it. ``overrides`` are Hydra-style
    (``model=mlp``, ``optim.lr=1e-3``, ``+extra.x=1``, ``~key``). ``world_size``
    (default: ``$WORLD_SIZE`` if set) enables the parallel-layout checks.

    Returns a DictConfig typed by the stack's root schema (attribute access; use
    ``OmegaConf.to_object`` for dataclass instances). Raises one ``ConfigError``
    listing every problem.
    """
    stacks = discover_stacks() if stacks is None else stacks
    owner = find_experiment_stack(experiment, stack, stacks)
    dirs = _conf_dirs(owner, stacks)
    problems = ProblemCollector()
    group_overrides, key_overrides = _split_overrides(overrides, dirs, problems)
    composed = _compose_with_hydra(experiment, group_overrides, dirs)
    if isinstance(composed.get("experiment"), Mapping):
        raise ConfigError(
            "the experiment file put its keys under 'experiment.' instead of the root",
            key="experiment",
            value=experiment,
            fix=f"start experiment/{experiment}.yaml with the line '# @package _global_'",
        )
    _chosen_groups_win(composed, experiment, group_overrides, dirs)
    composed = _apply_key_overrides(composed, key_overrides, problems)
    given = _given_keys(group_overrides, key_overrides)
    for hook in owner.config_hooks:
        resolve_ref(hook)(composed, given, problems)
    composed.pop("experiment", None)
    composed.pop("stack", None)

    typed = _typed_root(composed, owner, stacks, problems)
    bad_keys: set[str] = set()
    renamed = {**CORE_RENAMED_KEYS, **owner.renamed_keys}
    take_renamed_keys(composed, typed, renamed, problems, bad_keys)
    merge_checked(typed, composed, problems, bad_keys)
    typed.experiment = experiment
    typed.stack = owner.name

    # Without validation (``config show --no-validate``) a required value left unset shows as
    # ``???`` instead of stopping the command.
    for key in missing_keys(typed) if validate else ():
        group = key.partition(".")[0]
        fix = f"set {key}=<value>"
        if key in ("model.name", "data.name"):
            options = group_options(group, dirs)
            fix = f"choose one with {group}=<option> ({group} options: {', '.join(options)})"
        problems.add(key, "required value is not set", fix=fix)
        bad_keys.add(key)
    for key, reason in unresolvable(typed):
        problems.add(
            key,
            f"cannot resolve interpolation: {reason}",
            fix="point the ${...} at an existing key holding a value of the right type",
        )
        bad_keys.add(key)
    if not problems.problems:
        OmegaConf.resolve(typed)  # downstream code and saved configs see plain values
    if validate:
        from longboat.core.config.validate import collect_problems

        for problem in collect_problems(typed, world_size=world_size, stacks=stacks):
            if problem.key not in bad_keys:
                problems.problems.append(problem)
    problems.raise_if_any()
    return typed


def stored_config(
    config: Mapping[str, Any], stack: str, *, stacks: Mapping[str, Stack] | None = None
) -> Any:
    """A run's config as it was stored (a checkpoint manifest's ``config``) as the stack's
    dataclasses again: the root schema and the registered model / data schemas, each stored
    value typed; keys the schema no longer has are left out (their defaults apply)."""
    stacks = discover_stacks() if stacks is None else stacks
    owner = stacks[stack]
    stored = {k: v for k, v in config.items() if k not in ("experiment", "stack")}
    ignored = ProblemCollector()  # a stored config is taken as far as today's schema goes
    typed = _typed_root(stored, owner, stacks, ignored)
    merge_checked(typed, stored, ignored, set())
    typed.experiment = str(config.get("experiment") or typed.experiment)
    typed.stack = owner.name
    return OmegaConf.to_object(typed)


def to_dataclass(cfg: DictConfig) -> ExperimentConfig:
    """The composed config as dataclass instances (root schema and registered subclasses)."""
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


__all__ = [
    "GROUPS",
    "PRIMARY_CONFIG",
    "compose_experiment",
    "find_experiment_stack",
    "group_options",
    "known_groups",
    "list_experiments",
    "stored_config",
    "to_dataclass",
]
