"""Replay a whole training step as one CUDA graph.

A step of a model with many small layers (a VLA's 32-block DiT at a few hundred rows, the
frozen vision tower, per-embodiment heads) issues thousands of kernel launches; the host
then needs longer to launch them than the GPU needs to run them, and the GPU idles. A CUDA
graph records the step's kernels once and replays them with one launch.

``GraphedStep(fn)`` wraps a step function ``fn(inputs) -> outputs`` (``inputs`` a mapping of
name -> tensor, ``outputs`` any nest of tensors). Every call runs exactly one real step:

1. the first ``warmup`` calls run ``fn`` eagerly on a side stream (lazy state such as the
   optimizer's moments and cuDNN/cuBLAS workspaces gets allocated there, outside the graph);
   the last of them runs under CUDA's sync-debug mode ("warn") and, if the step
   synchronised with the host anywhere, raises ``GraphCaptureError`` listing where (that
   step is complete; only the capture is refused), or, with ``eager_on_sync=True``, warns
   once and runs every later call eagerly;
2. the next call copies its inputs into static buffers, records ``fn`` into a graph, and
   replays the graph once for that same batch;
3. later calls copy their inputs into the static buffers and replay.

What ``fn`` must satisfy (the usual CUDA-graph rules): the same input shapes and dtypes on
every call (a change raises ``GraphInputError`` naming the key; pad batches to fixed sizes),
no host synchronisation (``.item()``, ``.cpu()``, ``print(tensor)``, data-dependent shapes
such as ``nonzero``), no CPU-side state that changes between steps (a learning rate must live
in a device tensor updated in place), and gradients that are not set to None inside ``fn``
(zero them in place, or leave them None before the capture so that backward allocates them
inside the graph and overwrites them on every replay). RNG draws from the default CUDA
generator are graph-safe: each replay continues from the generator's current seed and
offset, so ``torch.manual_seed(s)`` before a call gives the same draws as an eager step.

The returned outputs are the graph's static tensors: the next call overwrites them. Read
(or clone) what you keep before calling again.

On an accelerator without CUDA graphs, or with ``enabled=False``, ``GraphedStep`` calls
``fn`` directly; ``reason`` says why. When the capture itself fails (an op that cannot be
captured) ``GraphCaptureError`` says so: the capture ran the step's Python side without its
kernels, so gradients and optimizer state can no longer be trusted and the run must restart
(from its last checkpoint) with the graph off; this happens at step ``warmup + 1``. Restart
the process, too: torch leaves the CUDA generator of a failed capture unusable ("Offset
increment outside graph capture" on the next random op).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)


class GraphInputError(ValueError):
    """A call's inputs do not match the captured graph's (key, shape, dtype or device)."""


class GraphCaptureError(RuntimeError):
    """The step could not be recorded as a CUDA graph (a host sync, a dynamic shape...)."""


def _signature(inputs: Mapping[str, Any]) -> dict[str, Any]:
    sig: dict[str, Any] = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            sig[key] = ("tensor", tuple(value.shape), value.dtype, value.device)
        else:
            sig[key] = ("value", value)
    return sig


def _describe(entry: Any) -> str:
    if entry is None:
        return "missing"
    if entry[0] == "tensor":
        _, shape, dtype, device = entry
        return f"{list(shape)} {dtype} on {device}"
    return repr(entry[1])


class GraphedStep:
    """Capture ``fn`` once after ``warmup`` eager calls and replay it (see the module doc).

    ``accelerator``: the run's accelerator (graphs are used where its device type is
    ``cuda``); ``enabled=False`` keeps every call eager; ``name`` labels log lines.
    """

    def __init__(
        self,
        fn: Callable[[Mapping[str, Any]], Any],
        *,
        accelerator: Any,
        warmup: int = 3,
        enabled: bool = True,
        name: str = "train step",
        backend: Any = None,
        eager_on_sync: bool = False,
    ) -> None:
        # ``backend``: side streams + capture; default: ``accelerator.graph_backend()``.
        if warmup < 1:
            raise ValueError(
                f"GraphedStep warmup={warmup}: use >= 1 (lazy state must exist before capture)"
            )
        self.fn = fn
        self.eager_on_sync = eager_on_sync
        self.warmup = warmup
        self.name = name
        self.calls = 0
        self.replays = 0
        self._replay: Callable[[], None] | None = None
        self._static_in: dict[str, Any] = {}
        self._static_out: Any = None
        self._sig: dict[str, Any] | None = None
        self.reason: str | None = None
        device_type = getattr(accelerator, "device_type", "cpu")
        if backend is None and enabled:
            make = getattr(accelerator, "graph_backend", None)
            backend = make() if callable(make) else None
        if not enabled:
            self.reason = "disabled by configuration"
        elif backend is None:
            self.reason = f"the {device_type} accelerator has no CUDA graphs"
        else:
            self._backend = backend
        if self.reason:
            log.info("%s: eager (%s)", name, self.reason)

    @property
    def active(self) -> bool:
        """True while calls go (or will go) through a graph."""
        return self.reason is None

    @property
    def captured(self) -> bool:
        return self._replay is not None

    def __call__(self, inputs: Mapping[str, Any]) -> Any:
        self.calls += 1
        if not self.active:
            return self.fn(inputs)
        if self._replay is None and self.calls < self.warmup:
            return self._backend.run_on_side_stream(lambda: self.fn(inputs))
        if self._replay is None and self.calls == self.warmup:
            # The last warm-up step also looks for host syncs, which would break the capture:
            # the step itself completes eagerly, so nothing is lost when this raises.
            out, syncs = self._backend.run_and_find_syncs(lambda: self.fn(inputs))
            if syncs:
                self.reason = f"{len(syncs)} host sync(s) in the step"
                if self.eager_on_sync:
                    warnings.warn(
                        f"{self.name}: eager steps from here on: the step synchronises with "
                        f"the host, which a CUDA graph cannot record (first at "
                        f"{syncs[0]})",
                        stacklevel=2,
                    )
                    return out
                raise GraphCaptureError(
                    f"{self.name}: the step synchronises with the host, which a CUDA graph cannot "
                    f"record (step {self.calls} ran eagerly and is complete). Where:\n  "
                    + "\n  ".join(dict.fromkeys(syncs))
                    + "\nRemove these (.item(), .cpu(), nonzero, Python-data tensors...) or run "
                    "with the graph turned off"
                )
            return out
        if self._replay is None:
            return self._capture_and_run(inputs)
        self._check(inputs)
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor):
                self._static_in[key].copy_(value, non_blocking=True)
        self._replay()
        self.replays += 1
        return self._static_out

    def _check(self, inputs: Mapping[str, Any]) -> None:
        sig = _signature(inputs)
        if sig == self._sig:
            return
        assert self._sig is not None
        for key in sorted(set(sig) | set(self._sig)):
            if sig.get(key) != self._sig.get(key):
                raise GraphInputError(
                    f"{self.name}: input {key!r} is {_describe(sig.get(key))} but the captured "
                    f"graph was recorded with {_describe(self._sig.get(key))}; a CUDA-graphed "
                    "step needs the same shapes every step (pad batches to a fixed size or "
                    "turn the graph off)"
                )

    def _capture_and_run(self, inputs: Mapping[str, Any]) -> Any:
        self._sig = _signature(inputs)
        self._static_in = {
            k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()
        }
        try:
            replay, out = self._backend.capture(lambda: self.fn(self._static_in))
        except Exception as exc:
            self.reason = f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            # A failed capture ran the step's Python side without its kernels: gradients and
            # optimizer state may hold garbage, so the run stops here rather than go on.
            raise GraphCaptureError(
                f"{self.name}: CUDA graph capture failed ({type(exc).__name__}: {exc}). The "
                "step must be free of host syncs and data-dependent shapes; run with the "
                "graph turned off to train eagerly"
            ) from exc
        self._replay, self._static_out = replay, out
        log.info("%s: captured as one CUDA graph after %d eager steps", self.name, self.warmup)
        self._replay()  # the capture recorded the work without running it
        self.replays += 1
        return self._static_out
