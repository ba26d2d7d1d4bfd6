"""Native checkpoints: torch.distributed.checkpoint shards, atomic, checksummed, resumable.

``CheckpointManager(cfg.checkpoint, config_dict).save(step, state)`` /
``.load(state)``; see ``manager.py`` for the on-disk layout.
"""

from longboat.core.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWarning,
    InvalidCheckpointError,
)
from longboat.core.checkpoint.manager import (
    TEST_PAUSE_AT_ENV,
    TEST_PAUSE_ENV,
    CheckpointManager,
    step_dir_name,
)
from longboat.core.checkpoint.manifest import MANIFEST_NAME, Manifest, read_manifest

__all__ = [
    "MANIFEST_NAME",
    "TEST_PAUSE_AT_ENV",
    "TEST_PAUSE_ENV",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointWarning",
    "InvalidCheckpointError",
    "Manifest",
    "read_manifest",
    "step_dir_name",
]
