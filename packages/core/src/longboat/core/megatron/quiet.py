"""Quiet megatron-core: its import-time and deprecation chatter is not a user's concern."""

from __future__ import annotations

import logging
import warnings


def quiet_megatron() -> None:
    """Silence megatron-core's import-time and deprecation chatter (not our users' concern)."""
    for name in ("megatron", "megatron.core", "torch.utils.cpp_extension"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in (
        r"megatron(\..*)?",
        r"transformer_engine(\..*)?",
        r"torch\.utils\.cpp_extension",
    ):
        warnings.filterwarnings("ignore", module=module)
    warnings.filterwarnings("ignore", category=SyntaxWarning)  # escapes in megatron sources
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks.*")
    warnings.filterwarnings(
        "ignore", message=r".*\.grad attribute of a Tensor that is not a leaf.*"
    )
