"""Find what would break a CUDA-graph capture of a step, on any device (CPU included).

A captured step must not read device values on the host, create data-dependent shapes,
copy Python data to the device, or reseed an RNG. ``find_capture_hazards`` runs a function
under a ``TorchDispatchMode`` that sees every aten op and records the ones that do, with the
Python frame that issued them, so a CPU test catches what a CUDA capture would reject (or,
worse, record with a baked-in value).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longboat.core.device.registry import accelerator_class, registered_accelerators

aten = torch.ops.aten

_UNSAFE = {
    aten._local_scalar_dense.default: "reads a device value on the host (.item(), bool(), "
    ".tolist(), float())",
    aten.nonzero.default: "data-dependent output shape (nonzero / torch.where(cond))",
    aten.masked_select.default: "data-dependent output shape (masked_select)",
    aten._unique2.default: "data-dependent output shape (unique)",
    aten.unique_dim.default: "data-dependent output shape (unique)",
    aten.unique_consecutive.default: "data-dependent output shape (unique_consecutive)",
}


@dataclass(frozen=True)
class CaptureHazard:
    """One op (or RNG call) that a CUDA graph cannot capture as a replayable step."""

    op: str
    why: str
    where: str
    """The innermost frame of the caller outside torch (file:line function)."""


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and "capture_check" not in name:
            return f"{name}:{frame.lineno} {frame.name}"
    return "?"


def _has_bool_index(indices: Any) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in (indices or ())
    )


class _HazardMode(TorchDispatchMode):
    def __init__(self, found: list[CaptureHazard]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _UNSAFE.get(func)
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            if _has_bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
                why = "boolean-mask indexing (a hidden nonzero: data-dependent shape)"
        elif func is aten.lift_fresh.default and args[0].dim() > 0:
            # 0-dim CPU tensors are wrapped scalars (no copy); others become an H2D copy.
            why = "a tensor built from Python data (torch.tensor(list)): a host->device copy"
        if why is not None:
            self.found.append(CaptureHazard(str(func), why, _caller()))
        return func(*args, **kwargs)


@contextlib.contextmanager
def capture_hazards() -> Iterator[list[CaptureHazard]]:
    """Context that collects the hazards of everything run inside it (a list it yields)."""
    found: list[CaptureHazard] = []
    patched = {}
    depth = [0]  # torch.manual_seed seeds the device generators too: report the outer call

    def reseed(name: str, original: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                found.append(
                    CaptureHazard(
                        name, "reseeds an RNG (seed outside the captured step)", _caller()
                    )
                )
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    targets = [(torch, "manual_seed"), (torch, "set_rng_state"), (torch.random, "fork_rng")]
    for name in registered_accelerators():  # each device's own seeding (CUDA's, ...)
        targets += accelerator_class(name).rng_reseed_functions()
    for owner, attr in targets:
        original = getattr(owner, attr)
        patched[(owner, attr)] = original
        setattr(owner, attr, reseed(f"{owner.__name__}.{attr}", original))
    try:
        with _HazardMode(found):
            yield found
    finally:
        for (owner, attr), original in patched.items():
            setattr(owner, attr, original)


def find_capture_hazards(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[CaptureHazard]:
    """Run ``fn(*args, **kwargs)`` once and return what would break its CUDA-graph capture
    (empty when it is capture-safe as far as the ops show). The call really runs."""
    with capture_hazards() as found:
        fn(*args, **kwargs)
    return found
