"""SmolVLA (LeRobot's SmolVLM2-based VLA; ``FAMILY``: its ``PolicyFamily``)."""

from longboat.embodied.models.smolvla.config import SmolVLAConfig
from longboat.embodied.models.smolvla.model import SmolVLA
from longboat.embodied.models.smolvla.policy import FAMILY

__all__ = ["FAMILY", "SmolVLA", "SmolVLAConfig"]
