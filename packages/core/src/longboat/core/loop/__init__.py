"""Training-loop parts every stack shares: LR schedules, metrics, progress, NaN guard,
signals, a step-range profiler, a CUDA-graphed step and a host-read recorder."""

from longboat.core.loop.capture_check import CaptureHazard, capture_hazards, find_capture_hazards
from longboat.core.loop.cuda_graph import GraphCaptureError, GraphedStep, GraphInputError
from longboat.core.loop.host_reads import HostReads
from longboat.core.loop.lr_schedule import SCHEDULES, build_lr_scheduler
from longboat.core.loop.metrics import MetricsSink
from longboat.core.loop.nan_guard import (
    DeferredNaNGuard,
    NaNGuard,
    NonFiniteLossError,
    Verdict,
)
from longboat.core.loop.profiler import StepProfiler
from longboat.core.loop.progress import TrainProgress
from longboat.core.loop.signals import GracefulShutdown

__all__ = [
    "SCHEDULES",
    "CaptureHazard",
    "DeferredNaNGuard",
    "GracefulShutdown",
    "GraphCaptureError",
    "GraphInputError",
    "GraphedStep",
    "HostReads",
    "MetricsSink",
    "NaNGuard",
    "NonFiniteLossError",
    "StepProfiler",
    "TrainProgress",
    "Verdict",
    "build_lr_scheduler",
    "capture_hazards",
    "find_capture_hazards",
]
