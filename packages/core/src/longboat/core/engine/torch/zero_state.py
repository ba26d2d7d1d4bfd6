"""Checkpoint state of a ZeRO-1 optimizer.

Core's ``CheckpointManager`` shards ``nn.Module`` / ``Optimizer`` values through
DCP (FQN keys, resharding across world sizes), but torch's DCP helpers do not
understand ``ZeroRedundancyOptimizer``. Like DeepSpeed, each rank therefore saves
the 1/N optimizer-state partition it owns (as per-rank checkpoint extras);
loading needs the same world size, which is checked with a clear error.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from longboat.core.config.errors import ConfigError


class ZeroShardState:
    """This rank's partition of a ZeRO-1 optimizer state (``state_dict``/``load_state_dict``)."""

    def __init__(self, optimizer: ZeroRedundancyOptimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return {
            "world_size": dist.get_world_size(),
            "rank": dist.get_rank(),
            "local": self.optimizer.optim.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        world = dist.get_world_size()
        if state_dict["world_size"] != world or state_dict["rank"] != dist.get_rank():
            raise ConfigError(
                f"the checkpoint's ZeRO-1 optimizer state was saved by {state_dict['world_size']} "
                f"ranks and is partitioned per rank; this run has {world}",
                key="parallel.strategy",
                value="zero1",
                fix="resume with the same number of processes, or save under ddp/fsdp "
                "(resharded by DCP) to change the world size",
            )
        self.optimizer.optim.load_state_dict(state_dict["local"])
