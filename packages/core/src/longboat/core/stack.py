"""Stacks: how an installed package plugs its configs and commands into longboat.

A stack (llm, vlm, diffusion, embodied, ...) exposes one ``Stack`` object through
the ``longboat.stacks`` entry-point group, e.g. in its ``pyproject.toml``::

    [project.entry-points."longboat.stacks"]
    llm = "longboat.llm.stack:STACK"

``discover_stacks()`` reads that group, so only installed stacks appear. Core
itself is always present as the built-in stack ``core``.

Schemas and the train function may be given as ``"module:attr"`` strings so that
discovering stacks (``longboat stacks``) imports nothing heavy; they are imported
when a config is actually composed or a run starts.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longboat.core.config.capabilities import Capabilities
from longboat.core.config.schema import DataConfig, ExperimentConfig, ModelConfig

ENTRY_POINT_GROUP = "longboat.stacks"
"""Entry-point group that stacks register their ``Stack`` object under."""

CORE_CONF_DIR = Path(__file__).with_name("conf")
"""Core's own config directory: the primary config and the default group options."""

Ref = str
"""A lazy ``"package.module:attribute"`` reference."""


def resolve_ref(ref: Any) -> Any:
    """Import ``"module:attr"`` (dots allowed in attr); anything else is returned unchanged."""
    if not isinstance(ref, str):
        return ref
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"Bad reference {ref!r}: expected 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True, kw_only=True)
class Stack:
    """What a stack contributes to longboat: configs, schemas and commands."""

    name: str
    """Short name (``llm``); also the entry-point name."""
    description: str
    """One line shown by ``longboat stacks``."""
    config_dir: Path | str | None = None
    """Directory holding the stack's config groups (``model/``, ``data/``, ``experiment/`` ...)."""
    config_package: str | None = None
    """Alternative to ``config_dir``: an importable package whose folder holds the YAML."""
    root_schema: type[ExperimentConfig] | Ref = ExperimentConfig
    """Root dataclass of this stack's experiments (a subclass of ``ExperimentConfig``)."""
    model_schemas: Mapping[str, type[ModelConfig] | Ref] = field(default_factory=dict)
    """Model dataclass per ``model.name``; ``model.*`` keys are checked against it (a name
    not listed here takes the ``schema`` of the stack's family of that name)."""
    families_package: str | None = None
    """The package whose subpackages are the stack's model families, each exposing a
    ``FAMILY`` object (``longboat.llm.models``); see ``longboat.core.family``."""
    data_schemas: Mapping[str, type[DataConfig] | Ref] = field(default_factory=dict)
    """Data dataclass per ``data.name``; ``data.*`` keys are checked against it."""
    console_script: str | None = None
    """The stack's own command (``longboat-llm``), if it has one."""
    train: Callable[[Any], Any] | Ref | None = None
    """Function that runs an experiment from a validated config (``train`` subcommand)."""
    validators: tuple[Callable[..., None] | Ref, ...] = ()
    """Extra cross-field checks ``fn(cfg, world_size, problems: ProblemCollector)``."""
    config_hooks: tuple[Callable[..., None] | Ref, ...] = ()
    """Functions ``fn(composed: dict, given: set[str], problems)`` run on the composed config
    before it is typed: they may fill keys the command line did not set (``given`` holds
    the keys and groups it did set, e.g. ``model.hidden_size`` or ``model``)."""
    examples: tuple[str, ...] = ()
    """Command lines shown at the end of the stack command's ``--help``."""
    distribution: str | None = None
    """The distribution that installs the stack (``longboat-llm``), for ``--version``."""
    capabilities: Capabilities = field(default_factory=Capabilities)
    """What the stack honours of core's ``train.*`` / ``export.*`` keys; other values are
    refused at compose time, naming the key and what the stack offers."""
    renamed_keys: Mapping[str, str] = field(default_factory=dict)
    """The stack's old key names -> their replacements (an old name is refused naming the
    replacement; core's own renames are in ``longboat.core.config.renamed``)."""

    def conf_path(self) -> Path | None:
        """The config directory on disk, or None when the stack ships no configs."""
        if self.config_dir is not None:
            return Path(self.config_dir)
        if self.config_package is not None:
            spec = importlib.util.find_spec(self.config_package)
            if spec is None or not spec.submodule_search_locations:
                raise ValueError(
                    f"Stack {self.name!r}: config_package {self.config_package!r} is not an "
                    "importable package directory"
                )
            return Path(next(iter(spec.submodule_search_locations)))
        return None

    def experiments(self) -> list[str]:
        """Experiment names under ``<conf>/experiment/`` (nested folders give ``a/b``)."""
        conf = self.conf_path()
        if conf is None or not (conf / "experiment").is_dir():
            return []
        root = conf / "experiment"
        return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))

    def group_options(self, group: str) -> list[str]:
        """Option names of one config group (``model`` -> ``["mlp", ...]``) in this stack."""
        conf = self.conf_path()
        if conf is None or not (conf / group).is_dir():
            return []
        return sorted(p.stem for p in (conf / group).glob("*.yaml"))

    def resolve_root_schema(self) -> type[ExperimentConfig]:
        """The root dataclass, imported if given as a reference."""
        schema = resolve_ref(self.root_schema)
        if not (isinstance(schema, type) and issubclass(schema, ExperimentConfig)):
            raise TypeError(
                f"Stack {self.name!r}: root_schema must subclass ExperimentConfig, got {schema!r}"
            )
        return schema

    def model_schema(self, model_name: str) -> type[ModelConfig] | None:
        """The dataclass registered for ``model.name``, or None."""
        ref = self.model_schemas.get(model_name)
        if ref is None:
            from longboat.core.family import families

            family = families(self.name).get(model_name)
            return None if family is None else family.model_schema()
        return resolve_ref(ref)

    def data_schema(self, data_name: str) -> type[DataConfig] | None:
        """The dataclass registered for ``data.name``, or None."""
        ref = self.data_schemas.get(data_name)
        return None if ref is None else resolve_ref(ref)

    def models(self) -> list[tuple[str, str, str]]:
        """``(option, family, flavor)`` of every option of the stack's ``model`` group (what
        ``model=<option>`` selects), read from the YAML files."""
        conf = self.conf_path()
        if conf is None or not (conf / "model").is_dir():
            return []
        from omegaconf import OmegaConf

        out = []
        for path in sorted((conf / "model").glob("*.yaml")):
            node = OmegaConf.load(path)
            out.append((path.stem, str(node.get("name", "?")), str(node.get("flavor", "-"))))
        return out

    def resolve_train(self) -> Callable[[Any], Any] | None:
        """The train function, imported if given as a reference."""
        return resolve_ref(self.train) if self.train is not None else None


CORE_STACK = Stack(
    name="core",
    description="Built-in: default config groups and the small end-to-end `demo` experiment.",
    config_dir=CORE_CONF_DIR,
    model_schemas={"mlp": "longboat.core.demo:MLPConfig"},
    data_schemas={"synthetic_regression": "longboat.core.demo:SyntheticRegressionConfig"},
    console_script="longboat",
    train="longboat.core.demo:run",
    capabilities=Capabilities(),
    examples=(
        "longboat demo                                  # train, checkpoint, resume an MLP on CPU",
        "longboat config show demo optim.lr=3e-3        # the resolved config",
        "longboat models                                # model families of the installed stacks",
    ),
    distribution="longboat-core",
)
"""Core registers itself as the built-in stack ``core``."""


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


_LOADED: dict[tuple[str, str], Stack | None] = {}
"""Entry points already loaded, by (name, value): each stack is imported and warned about once."""


def _load(ep: importlib.metadata.EntryPoint) -> Stack | None:
    try:
        obj = ep.load()
    except Exception as exc:  # any import error of a third-party stack
        warnings.warn(
            f"longboat stack {ep.name!r} ({ep.value}) failed to load and is skipped: {exc}",
            stacklevel=3,
        )
        return None
    if not isinstance(obj, Stack):
        warnings.warn(
            f"longboat stack entry point {ep.name!r} ({ep.value}) is a "
            f"{type(obj).__name__}, not a longboat.core.stack.Stack; skipped",
            stacklevel=3,
        )
        return None
    if obj.name != ep.name:
        warnings.warn(
            f"longboat stack entry point {ep.name!r} points at Stack(name={obj.name!r}); "
            "using the Stack's name",
            stacklevel=3,
        )
    return obj


def discover_stacks() -> dict[str, Stack]:
    """Every installed stack by name: ``core`` first, then entry points sorted by name.

    A stack whose entry point fails to load is skipped with a warning (once per
    process), so one broken install does not take the whole CLI down.
    """
    stacks: dict[str, Stack] = {CORE_STACK.name: CORE_STACK}
    for ep in sorted(_entry_points(), key=lambda e: e.name):
        cache_key = (ep.name, ep.value)
        if cache_key not in _LOADED:
            _LOADED[cache_key] = _load(ep)
        stack = _LOADED[cache_key]
        if stack is None:
            continue
        if stack.name in stacks:
            if stacks[stack.name] is not stack:
                warnings.warn(
                    f"longboat stack {stack.name!r} registered twice; keeping the first",
                    stacklevel=2,
                )
            continue
        stacks[stack.name] = stack
    return stacks


def get_stack(name: str, stacks: Mapping[str, Stack] | None = None) -> Stack:
    """One installed stack by name; ConfigError with a did-you-mean when it is not installed."""
    from longboat.core.config.errors import ConfigError
    from longboat.core.config.suggest import did_you_mean

    stacks = discover_stacks() if stacks is None else stacks
    if name in stacks:
        return stacks[name]
    raise ConfigError(
        "no such stack is installed",
        key="stack",
        value=name,
        fix=did_you_mean(name, list(stacks), what="installed stacks"),
    )


__all__ = [
    "CORE_CONF_DIR",
    "CORE_STACK",
    "ENTRY_POINT_GROUP",
    "Stack",
    "discover_stacks",
    "get_stack",
    "resolve_ref",
]
