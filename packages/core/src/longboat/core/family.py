"""Model families: one typed contract and one registry for every stack.

A *family* is one model architecture a stack trains (``llama3`` in llm, ``qwen2_5_vl`` in
vlm, ``wan`` in diffusion, a policy in embodied). It is described by one ``Family`` object:
its config schema and size flavors (``tiny`` always), how to build it, the adapter between
its weights and its ecosystem's format (HF / diffusers / LeRobot / Isaac), the processor
its inputs need, its loss and its FLOPs per sample. A stack may subclass ``Family`` to add
typed fields of its own (e.g. the layer spec of a Megatron decoder).

Families are found, never named by a string module path:

- by convention: each subpackage of a stack's ``Stack.families_package`` that exposes a
  module-level ``FAMILY`` object (``longboat.llm.models.qwen3.FAMILY``);
- by entry point: ``[project.entry-points."longboat.families"]`` of a third-party
  distribution, each pointing at a ``Family``;
- by folder: ``LONGBOAT_FAMILY_PATH`` (``os.pathsep``-separated folders): every subfolder
  holding an ``__init__.py`` is imported by location as a family package, and the folder's
  ``conf/`` (``conf/model/<option>.yaml``) joins the config search path, so ``model=<option>``
  selects it with no edit to the installed stack.

``find_family(stack, name)`` / ``list_families(stack)`` answer from all three. This module
imports no torch and no megatron: a family package's ``__init__`` keeps its heavy imports
inside functions, so listing families stays cheap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import pkgutil
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from longboat.core.config.errors import ConfigError
from longboat.core.config.suggest import did_you_mean

FAMILY_ATTRIBUTE = "FAMILY"
"""The module-level name a family package exposes its ``Family`` under."""

ENTRY_POINT_GROUP = "longboat.families"
"""Entry-point group of third-party families (each entry: a ``Family`` object)."""

FAMILY_PATH_ENV = "LONGBOAT_FAMILY_PATH"
"""Environment variable: folders (``os.pathsep``-separated) of out-of-tree family packages."""

_PATH_PACKAGE = "longboat_family_path"
"""Parent module name under which ``LONGBOAT_FAMILY_PATH`` packages are imported."""


@runtime_checkable
class StateDictAdapter(Protocol):
    """Moves a family's weights between longboat and one ecosystem format.

    ``format`` names the ecosystem (``hf``, ``diffusers``, ``lerobot``, ``isaac``);
    ``read_config`` gives the family's architecture config of a checkpoint directory;
    ``load`` fills a built model from a directory (returns the tensors read) and ``save``
    writes one that the ecosystem's library loads.
    """

    format: str

    def read_config(self, directory: str | Path) -> Any:
        """The architecture config a checkpoint directory describes."""
        ...

    def load(self, model: Any, config: Any, directory: str | Path) -> int:
        """Load the directory's weights into ``model``; the number of tensors read."""
        ...

    def save(self, model: Any, config: Any, directory: str | Path) -> Path:
        """Write ``model`` as a checkpoint of this format; the directory written."""
        ...


class LazyFlavors(Mapping[str, Any]):
    """Flavors whose names are known up front and whose configs are made on first lookup
    (``make(name)``), for families whose configs live in heavy modules."""

    def __init__(self, names: Iterable[str], make: Callable[[str], Any]) -> None:
        self._names = tuple(names)
        self._make = make

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        return self._make(name)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Any:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True, kw_only=True)
class Family:
    """What longboat knows about one model family (the contract every stack's families
    implement; a stack subclasses it for fields only its engine reads)."""

    name: str
    """Registry name: the ``model.name`` that selects the family."""
    stack: str
    """The stack that trains it (``llm``, ``vlm``, ``diffusion``, ``embodied``)."""
    schema: type | Callable[[], type]
    """Dataclass of the ``model`` config section of this family (``model.*`` keys are
    checked against it), or a function returning it where importing it is heavy."""
    flavors: Mapping[str, Any]
    """Size flavors by name (architecture configs); ``tiny`` always exists and trains on CPU
    in seconds."""
    description: str = ""
    """One line shown by ``longboat models``."""
    build: Callable[..., Any] | None = None
    """``build(config, **engine_options)`` -> the model (or this rank's chunks)."""
    adapter: StateDictAdapter | None = None
    """Weights to and from the family's ecosystem format (None: native checkpoints only)."""
    checkpoint_types: tuple[str, ...] = ()
    """Identifiers of the ecosystem's checkpoints this family reads (HF ``model_type`` or
    ``architectures`` values, diffusers ``_class_name``, a LeRobot policy ``type``)."""
    processor: Callable[..., Any] | None = None
    """``processor(config, ...)`` -> what turns raw samples into model inputs, where the
    inputs need one (tokenizer + image processor, action normaliser)."""
    batch_spec: Callable[..., Mapping[str, Any]] | None = None
    """``batch_spec(config, ...)`` -> the names and shapes of one batch's tensors."""
    loss: Callable[..., Any] | None = None
    """The training loss, where the family defines its own (else the stack's)."""
    flops_per_sample: Callable[..., float] | None = None
    """``flops_per_sample(config, **sample_shape)`` -> training FLOPs (forward + backward)
    of one sample, for MFU."""
    config_dir: Path | None = None
    """A folder of config groups the family ships (``model/<option>.yaml``), added to the
    stack's config search path (for entry-point families; in-tree ones use the stack's)."""

    def __post_init__(self) -> None:
        if "tiny" not in self.flavors:
            raise ValueError(
                f"family {self.name!r} ({self.stack}) has no 'tiny' flavor: every family "
                "ships one that trains on CPU in seconds"
            )

    def model_schema(self) -> type:
        """The dataclass of the ``model`` section (``schema``, called if it is a function)."""
        return self.schema if isinstance(self.schema, type) else self.schema()

    def flavor(self, name: str) -> Any:
        """A copy of flavor ``name``; a ``ConfigError`` naming ``model.flavor`` otherwise."""
        if name not in self.flavors:
            raise ConfigError(
                f"family {self.name!r} has flavors {sorted(self.flavors)}",
                key="model.flavor",
                value=name,
                fix=did_you_mean(name, list(self.flavors), what=f"{self.name} flavors"),
            )
        value = self.flavors[name]
        return dataclasses.replace(value) if dataclasses.is_dataclass(value) else value


# -- discovery --------------------------------------------------------------------------


def family_path() -> list[Path]:
    """The folders named by ``LONGBOAT_FAMILY_PATH`` (in order, empty entries dropped)."""
    raw = os.environ.get(FAMILY_PATH_ENV, "")
    return [Path(p) for p in raw.split(os.pathsep) if p.strip()]


def family_conf_dirs() -> list[Path]:
    """Config folders of out-of-tree families: each ``LONGBOAT_FAMILY_PATH`` folder's
    ``conf/`` and the ``config_dir`` of entry-point families."""
    dirs = [folder / "conf" for folder in family_path() if (folder / "conf").is_dir()]
    for family in _entry_point_families():
        if family.config_dir is not None and Path(family.config_dir).is_dir():
            dirs.append(Path(family.config_dir))
    return dirs


_MODULES: dict[str, types.ModuleType | None] = {}
"""Family modules already imported (or failed), by module name: each warns once."""


def _warn_skip(what: str, exc: BaseException) -> None:
    warnings.warn(f"longboat family {what} failed to load and is skipped: {exc}", stacklevel=4)


def _import(name: str) -> types.ModuleType | None:
    if name not in _MODULES:
        try:
            _MODULES[name] = importlib.import_module(name)
        except Exception as exc:  # a broken family must not take the stack down
            _warn_skip(name, exc)
            _MODULES[name] = None
    return _MODULES[name]


def _package_families(package: str) -> list[Family]:
    pkg = _import(package)
    if pkg is None or not hasattr(pkg, "__path__"):
        return []
    out = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if not info.ispkg:
            continue
        module = _import(f"{package}.{info.name}")
        family = getattr(module, FAMILY_ATTRIBUTE, None) if module is not None else None
        if isinstance(family, Family):
            out.append(family)
    return out


def _import_by_location(folder: Path) -> types.ModuleType | None:
    """Import ``folder`` (holding ``__init__.py``) as ``longboat_family_path.<name>_<hash>``
    (the hash of its location keeps two folders of one name apart)."""
    if _PATH_PACKAGE not in sys.modules:
        parent = types.ModuleType(_PATH_PACKAGE)
        parent.__path__ = []  # a package, so relative imports inside families resolve
        sys.modules[_PATH_PACKAGE] = parent
    where = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:8]
    name = f"{_PATH_PACKAGE}.{folder.name}_{where}"
    key = f"{name}@{folder.resolve()}"
    if key in _MODULES:
        return _MODULES[key]
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = None
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            _warn_skip(str(folder), exc)
            module = None
    _MODULES[key] = module
    return module


def _path_families() -> list[Family]:
    out = []
    for folder in family_path():
        if not folder.is_dir():
            continue
        for sub in sorted(folder.iterdir()):
            if sub.is_dir() and (sub / "__init__.py").is_file():
                module = _import_by_location(sub)
                family = getattr(module, FAMILY_ATTRIBUTE, None) if module is not None else None
                if isinstance(family, Family):
                    out.append(family)
    return out


_ENTRY_POINTS: dict[tuple[str, str], Family | None] = {}


def _entry_point_families() -> list[Family]:
    out = []
    for ep in sorted(
        importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name
    ):
        key = (ep.name, ep.value)
        if key not in _ENTRY_POINTS:
            try:
                obj = ep.load()
            except Exception as exc:
                _warn_skip(f"entry point {ep.name!r} ({ep.value})", exc)
                obj = None
            if obj is not None and not isinstance(obj, Family):
                warnings.warn(
                    f"longboat family entry point {ep.name!r} ({ep.value}) is a "
                    f"{type(obj).__name__}, not a longboat.core.family.Family; skipped",
                    stacklevel=3,
                )
                obj = None
            _ENTRY_POINTS[key] = obj
        if _ENTRY_POINTS[key] is not None:
            out.append(_ENTRY_POINTS[key])
    return out


def _families_package(stack: str) -> str | None:
    from longboat.core.stack import discover_stacks

    found = discover_stacks().get(stack)
    return getattr(found, "families_package", None) if found is not None else None


_WARNED_TWICE: set[tuple[str, str, int]] = set()
"""Families already reported as taking a taken name (each is reported once)."""


def families(stack: str) -> dict[str, Family]:
    """Every family of ``stack`` by name: the stack's own package first, then entry points,
    then ``LONGBOAT_FAMILY_PATH``; a later family with a taken name is skipped with a
    warning (once). Families of other stacks (an entry point or a folder of the family path
    serves every stack) are left out by their ``stack``; each module is imported once."""
    package = _families_package(stack)
    found: Iterable[Family] = [
        *(_package_families(package) if package else []),
        *_entry_point_families(),
        *_path_families(),
    ]
    out: dict[str, Family] = {}
    for family in found:
        if family.stack != stack:
            continue
        if family.name in out:
            twice = (stack, family.name, id(family))
            if out[family.name] is not family and twice not in _WARNED_TWICE:
                _WARNED_TWICE.add(twice)
                warnings.warn(
                    f"{stack} family {family.name!r} is defined twice; keeping the first",
                    stacklevel=2,
                )
            continue
        out[family.name] = family
    return out


def list_families(stack: str) -> list[str]:
    """Names of every family of ``stack``, sorted."""
    return sorted(families(stack))


def find_family(stack: str, name: str) -> Family:
    """The family ``name`` of ``stack``; a ``ConfigError`` on ``model.name`` with a
    did-you-mean over the stack's families otherwise."""
    found = families(stack)
    if name in found:
        return found[name]
    raise ConfigError(
        f"no {stack} model family has this name",
        key="model.name",
        value=name,
        fix=did_you_mean(str(name), list(found), what=f"{stack} families"),
    )


def family_for_checkpoint(
    stack: str, identifiers: Iterable[str], *, key: str, where: str
) -> Family:
    """The family of ``stack`` whose ``checkpoint_types`` holds one of ``identifiers`` (an
    HF ``model_type`` then ``architectures``, a diffusers ``_class_name``, ...), tried in
    order; a ``ConfigError`` on ``key`` naming ``where`` and what the stack reads otherwise."""
    found = families(stack)
    identifiers = [i for i in identifiers if i]
    for ident in identifiers:
        for family in found.values():
            if ident in family.checkpoint_types:
                return family
    known = sorted({t for f in found.values() for t in f.checkpoint_types})
    raise ConfigError(
        f"{where}: {identifiers or 'no identifier'} is not a checkpoint any {stack} family reads",
        key=key,
        fix=f"longboat-{stack} reads {known}",
    )


__all__ = [
    "ENTRY_POINT_GROUP",
    "FAMILY_ATTRIBUTE",
    "FAMILY_PATH_ENV",
    "Family",
    "LazyFlavors",
    "StateDictAdapter",
    "families",
    "family_conf_dirs",
    "family_for_checkpoint",
    "family_path",
    "find_family",
    "list_families",
]
