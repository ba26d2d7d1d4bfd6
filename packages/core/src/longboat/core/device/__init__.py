"""Accelerator abstraction: the only place in longboat that talks to a device runtime.

Use ``get_accelerator()`` everywhere instead of ``torch.cuda``; plugins add
devices through the ``longboat.accelerators`` entry point.
"""

from longboat.core.device.base import (
    Accelerator,
    AcceleratorUnavailableError,
    HostEvent,
    NullStream,
)
from longboat.core.device.cpu import CPUAccelerator
from longboat.core.device.cuda import CUDAAccelerator
from longboat.core.device.registry import (
    ENTRY_POINT_GROUP,
    ENV_VAR,
    UnknownAcceleratorError,
    available_accelerators,
    get_accelerator,
    register_accelerator,
    registered_accelerators,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "Accelerator",
    "AcceleratorUnavailableError",
    "CPUAccelerator",
    "CUDAAccelerator",
    "HostEvent",
    "NullStream",
    "UnknownAcceleratorError",
    "available_accelerators",
    "get_accelerator",
    "register_accelerator",
    "registered_accelerators",
]
