"""Acting with an exported policy on raw observations: ``load_policy(export_dir)`` ->
``Policy`` (``select_action``, ``predict_action_chunk``), its ``PolicyProcessor`` saved with
every export."""

from longboat.embodied.inference.policy import Policy, load_policy
from longboat.embodied.inference.processor import PolicyProcessor, camera_frame

__all__ = ["Policy", "PolicyProcessor", "camera_frame", "load_policy"]
