"""Training objectives and samplers of diffusion models.

- :mod:`~longboat.diffusion.objective.schedule`: shifted sigmas, timestep sampling, loss weights.
- :mod:`~longboat.diffusion.objective.flow_matching`: :class:`FlowMatchingConfig` and
  :func:`flow_matching_loss` (rectified flow as Wan trains it).
- :mod:`~longboat.diffusion.objective.sampling`: the Euler sampler for few-step previews.
"""

from longboat.diffusion.objective.flow_matching import (
    FlowMatchingConfig,
    flow_matching_loss,
    timestep_weights,
)
from longboat.diffusion.objective.sampling import euler_step, sample, sampling_sigmas
from longboat.diffusion.objective.schedule import (
    bell_weights,
    draw_sigmas,
    shift_sigmas,
    training_sigmas,
)

__all__ = [
    "FlowMatchingConfig",
    "bell_weights",
    "draw_sigmas",
    "euler_step",
    "flow_matching_loss",
    "sample",
    "sampling_sigmas",
    "shift_sigmas",
    "timestep_weights",
    "training_sigmas",
]
