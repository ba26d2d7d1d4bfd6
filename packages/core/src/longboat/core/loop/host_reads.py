"""Where a training step reads tensor values on the host, found on any device.

A read of a device tensor's value on the host (``.item()``, ``float()``, ``bool()``,
``.tolist()``, ``.cpu()``, ``.numpy()``...) waits for everything queued before it: one per step
and the host can no longer run ahead of the device. ``GraphedStep``'s sync finder sees them on
CUDA only (torch's sync debug mode); ``HostReads`` records them on every device,
CPU included, so a test on a CPU machine can prove a loop reads nothing per step.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.overrides import TorchFunctionMode

READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "cpu",
        "__float__",
        "__int__",
        "__bool__",
        "__index__",
        "__format__",
    }
)
"""The tensor functions that hand a value to the host."""


class HostReads(TorchFunctionMode):
    """While active, records ``(tag(), function name, "file function")`` for every host read
    of a tensor value, located at the first caller frame outside torch and ``skip_files``.

    ``tag``: labels each record (e.g. the step the loop is on); ``skip_files``: frames of these
    files are not taken as the caller (a test's own wrappers).
    """

    def __init__(self, tag: Callable[[], Any] = lambda: None, skip_files: tuple[str, ...] = ()):
        super().__init__()
        self.tag = tag
        self.skip_files = set(skip_files)
        self.reads: list[tuple[Any, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in READS:
            where = "?"
            for frame in reversed(traceback.extract_stack()[:-1]):
                if "/torch/" not in frame.filename and frame.filename not in self.skip_files:
                    where = f"{Path(frame.filename).name} {frame.name}"
                    break
            self.reads.append((self.tag(), name, where))
        return func(*args, **(kwargs or {}))
