"""``mlp2x_gelu``: Linear -> GELU -> Linear on megatron's tensor-parallel linears."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule

from longboat.vlm.models.projector.config import ProjectorConfig


class MLP2xGeluProjector(MegatronModule):
    """``[N, input_size] -> [N, output_size]``: column-parallel ``linear_fc1`` (input ->
    output width), exact GELU, row-parallel ``linear_fc2`` (output -> output width)."""

    def __init__(self, config: Any, cfg: ProjectorConfig) -> None:
        super().__init__(config=config)
        if cfg.input_size is None or cfg.output_size is None:
            raise ValueError("resolve the projector's widths first (ProjectorConfig.resolved)")
        self.linear_fc1 = ColumnParallelLinear(
            cfg.input_size, cfg.output_size, config=config, init_method=config.init_method,
            bias=cfg.bias, gather_output=False, skip_bias_add=False,
        )  # fmt: skip
        self.linear_fc2 = RowParallelLinear(
            cfg.output_size, cfg.output_size, config=config,
            init_method=config.output_layer_init_method, bias=cfg.bias, input_is_parallel=True,
            skip_bias_add=False,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.linear_fc1(x)
        x, _ = self.linear_fc2(F.gelu(x))
        return x


def build_projector(config: Any, cfg: ProjectorConfig) -> torch.nn.Module:
    """The projector module of ``cfg`` (kind ``cfg.name``)."""
    cfg.validate()
    return MLP2xGeluProjector(config, cfg)
