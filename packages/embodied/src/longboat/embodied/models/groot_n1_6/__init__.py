"""GR00T N1.6-style VLA (``FAMILY``: its ``PolicyFamily``)."""

from longboat.embodied.models.groot_n1_6.config import GrootN16Config
from longboat.embodied.models.groot_n1_6.model import GrootN16
from longboat.embodied.models.groot_n1_6.policy import FAMILY

__all__ = ["FAMILY", "GrootN16", "GrootN16Config"]
