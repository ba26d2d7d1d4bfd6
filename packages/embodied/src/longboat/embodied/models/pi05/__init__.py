"""pi0.5-style VLA."""

from longboat.embodied.models.pi05.config import Pi05Config
from longboat.embodied.models.pi05.model import Pi05

__all__ = ["Pi05", "Pi05Config"]
