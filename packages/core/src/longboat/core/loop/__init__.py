"""Training-loop parts every stack shares: LR schedules, metrics, progress, NaN guard,
signals and a step-range profiler."""

from longboat.core.loop.lr_schedule import SCHEDULES, build_lr_scheduler
from longboat.core.loop.metrics import MetricsSink
from longboat.core.loop.nan_guard import NaNGuard, NonFiniteLossError
from longboat.core.loop.profiler import StepProfiler
from longboat.core.loop.progress import TrainProgress
from longboat.core.loop.signals import GracefulShutdown

__all__ = [
    "SCHEDULES",
    "GracefulShutdown",
    "MetricsSink",
    "NaNGuard",
    "NonFiniteLossError",
    "StepProfiler",
    "TrainProgress",
    "build_lr_scheduler",
]
