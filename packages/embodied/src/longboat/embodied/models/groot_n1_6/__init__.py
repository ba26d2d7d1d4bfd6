"""GR00T N1.6-style VLA."""

from longboat.embodied.models.groot_n1_6.config import GrootN16Config
from longboat.embodied.models.groot_n1_6.model import GrootN16

__all__ = ["GrootN16", "GrootN16Config"]
