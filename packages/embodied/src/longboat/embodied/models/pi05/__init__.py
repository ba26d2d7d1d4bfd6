"""pi0.5-style VLA (``FAMILY``: its ``PolicyFamily``)."""

from longboat.embodied.models.pi05.config import Pi05Config
from longboat.embodied.models.pi05.model import Pi05
from longboat.embodied.models.pi05.policy import FAMILY

__all__ = ["FAMILY", "Pi05", "Pi05Config"]
