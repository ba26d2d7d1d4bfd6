"""Distributed setup: torchrun init, parallel-config resolution, DeviceMesh, CPU test launcher;
the rank watchdog (``longboat.core.distributed.watchdog``) the trainer runs."""

from longboat.core.distributed.init import (
    DistInfo,
    check_precision_hardware,
    destroy_distributed,
    init_distributed,
    run_precision,
    set_collective_timeout,
    single_process_group,
    split_fp8,
)
from longboat.core.distributed.multiprocess import (
    MultiprocessError,
    find_free_port,
    run_multiprocess,
)
from longboat.core.distributed.parallel import (
    STRATEGIES,
    build_device_mesh,
    dp_mesh,
    mesh_shape,
    resolve_parallel,
)

__all__ = [
    "STRATEGIES",
    "DistInfo",
    "MultiprocessError",
    "build_device_mesh",
    "check_precision_hardware",
    "destroy_distributed",
    "dp_mesh",
    "find_free_port",
    "init_distributed",
    "mesh_shape",
    "resolve_parallel",
    "run_multiprocess",
    "run_precision",
    "set_collective_timeout",
    "single_process_group",
    "split_fp8",
]
