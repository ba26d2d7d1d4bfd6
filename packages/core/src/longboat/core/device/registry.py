"""Name -> accelerator class registry, entry-point plugins and selection.

Selection order of ``get_accelerator(name)``: an explicit ``name``, else the
``LONGBOAT_ACCELERATOR`` environment variable, else auto-detection (cuda when
available, then any available plugin, else cpu).
"""

from __future__ import annotations

import difflib
import os
import threading
from importlib.metadata import entry_points

from longboat.core.device.base import Accelerator, AcceleratorUnavailableError
from longboat.core.device.cpu import CPUAccelerator
from longboat.core.device.cuda import CUDAAccelerator

ENTRY_POINT_GROUP = "longboat.accelerators"
"""Entry-point group plugins use to register accelerator classes."""
ENV_VAR = "LONGBOAT_ACCELERATOR"
"""Environment variable that forces an accelerator by name (``auto`` = detect)."""

_lock = threading.RLock()
_registry: dict[str, type[Accelerator]] = {"cuda": CUDAAccelerator, "cpu": CPUAccelerator}
_plugin_errors: dict[str, str] = {}  # entry point name -> why loading it failed
_plugins_loaded = False
_instances: dict[str, Accelerator] = {}


class UnknownAcceleratorError(ValueError):
    """No accelerator is registered under the requested name."""


def register_accelerator(name: str, cls: type[Accelerator], *, override: bool = False) -> None:
    """Register ``cls`` under ``name`` (plugins normally use the entry point instead)."""
    if not (isinstance(cls, type) and issubclass(cls, Accelerator)):
        raise TypeError(f"register_accelerator({name!r}, ...): {cls!r} is not an Accelerator")
    with _lock:
        existing = _registry.get(name)
        if existing is not None and existing is not cls and not override:
            raise ValueError(
                f"Accelerator {name!r} is already registered as {existing.__qualname__}. "
                "Fix: pick another name or pass override=True."
            )
        _registry[name] = cls
        _instances.pop(name, None)


def _load_plugins() -> None:
    global _plugins_loaded
    with _lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in _registry:
                continue
            try:
                cls = ep.load()
            except Exception as exc:  # a broken plugin must not break the others
                _plugin_errors[ep.name] = f"entry point {ep.value!r} failed to load: {exc!r}"
                continue
            if not (isinstance(cls, type) and issubclass(cls, Accelerator)):
                _plugin_errors[ep.name] = f"entry point {ep.value!r} is not an Accelerator class"
                continue
            _registry[ep.name] = cls


def registered_accelerators() -> list[str]:
    """Every registered name (built-ins and plugins), available here or not."""
    _load_plugins()
    with _lock:
        return sorted(_registry)


def accelerator_class(name: str) -> type[Accelerator]:
    """The class registered under ``name`` (without creating it: no device is touched)."""
    _load_plugins()
    with _lock:
        if name not in _registry:
            raise UnknownAcceleratorError(_unknown_message(name, "accelerator_class"))
        return _registry[name]


def available_accelerators() -> list[str]:
    """Registered names whose runtime and devices are present on this machine."""
    return [name for name in registered_accelerators() if _safe_available(_registry[name])]


def _safe_available(cls: type[Accelerator]) -> bool:
    try:
        return bool(cls.is_available())
    except Exception:  # a plugin probing a half-installed runtime counts as unavailable
        return False


def _auto_name() -> str:
    if _safe_available(CUDAAccelerator):
        return "cuda"
    for name in registered_accelerators():
        if name not in ("cuda", "cpu") and _safe_available(_registry[name]):
            return name
    return "cpu"


def get_accelerator(name: str | None = None) -> Accelerator:
    """The accelerator for ``name`` (or ``$LONGBOAT_ACCELERATOR``, or auto-detected).

    Raises ``UnknownAcceleratorError`` listing the known names, or
    ``AcceleratorUnavailableError`` saying which runtime is missing. One
    instance per name is shared by the whole process.
    """
    source = "argument"
    if name is None:
        name = os.environ.get(ENV_VAR) or None
        source = f"${ENV_VAR}"
    if name is None or name.strip().lower() == "auto":
        name = _auto_name()
        source = "auto-detection"
    name = name.strip().lower()
    _load_plugins()
    with _lock:
        if name in _instances:
            return _instances[name]
        cls = _registry.get(name)
    if cls is None:
        raise UnknownAcceleratorError(_unknown_message(name, source))
    if not _safe_available(cls):
        hint = cls.runtime_hint or "its runtime and a visible device"
        raise AcceleratorUnavailableError(
            f"Accelerator {name!r} (selected by {source}) is registered "
            f"({cls.__module__}.{cls.__qualname__}) but not available on this machine: "
            f"it needs {hint}. Available here: {', '.join(available_accelerators())}. "
            f"Fix: install the missing runtime, or unset {ENV_VAR} / choose another accelerator."
        )
    with _lock:
        return _instances.setdefault(name, cls())


def _unknown_message(name: str, source: str) -> str:
    known = registered_accelerators()
    msg = f"Unknown accelerator {name!r} (selected by {source}). Known: {', '.join(known)}."
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        msg += f" Did you mean {close[0]!r}?"
    if name in _plugin_errors:
        msg += f" A plugin named {name!r} exists but {_plugin_errors[name]}."
    else:
        msg += (
            f" Fix: pick a known name, or install the plugin that registers {name!r} "
            f"through the {ENTRY_POINT_GROUP!r} entry point (e.g. longboat-xpu-plugin for 'xpu')."
        )
    return msg


def _reset_for_tests() -> None:
    """Forget plugins, instances and runtime registrations (tests only)."""
    global _plugins_loaded
    with _lock:
        _registry.clear()
        _registry.update({"cuda": CUDAAccelerator, "cpu": CPUAccelerator})
        _plugin_errors.clear()
        _instances.clear()
        _plugins_loaded = False
