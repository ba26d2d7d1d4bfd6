"""Per-embodiment ("category-specific") layers: weights W[E, in, out] picked by id.

Two batched implementations, no per-sample Python loop:
- ``bmm``: gather W[ids] and one ``bmm``; static shapes (compile friendly), but the
  gathered [B, in, out] copy is kept for backward (B x the layer's weights).
- ``grouped``: one matmul per embodiment present in the batch (at most E, usually
  a handful); no weight copies, but a host sync for ``unique`` and dynamic shapes.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

CategoryImpl = Literal["bmm", "grouped"]


def category_linear(
    x: Tensor, weight: Tensor, bias: Tensor, ids: Tensor, impl: CategoryImpl = "bmm"
) -> Tensor:
    """x [B, T, in] (or [B, in]); weight [E, in, out]; bias [E, out]; ids [B] -> [B, T, out]."""
    squeeze = x.dim() == 2
    if squeeze:
        x = x[:, None]
    x = x.to(weight.dtype)
    if impl == "bmm":
        out = torch.baddbmm(bias[ids][:, None], x, weight[ids])
    elif impl == "grouped":
        out = x.new_zeros(x.shape[0], x.shape[1], weight.shape[-1])
        for c in torch.unique(ids).tolist():
            idx = (ids == c).nonzero().squeeze(1)
            out = out.index_copy(
                0,
                idx,
                torch.addmm(bias[c], x[idx].flatten(0, 1), weight[c]).view(
                    len(idx), x.shape[1], -1
                ),
            )
    else:
        raise ValueError(f"category impl={impl!r} is unknown; use 'bmm' or 'grouped'")
    return out[:, 0] if squeeze else out


class CategorySpecificLinear(nn.Module):
    """Linear layer with one weight matrix per embodiment."""

    def __init__(
        self, num_categories: int, in_dim: int, out_dim: int, impl: CategoryImpl = "bmm"
    ) -> None:
        super().__init__()
        self.impl: CategoryImpl = impl
        self.weight = nn.Parameter(torch.empty(num_categories, in_dim, out_dim))
        self.bias = nn.Parameter(torch.empty(num_categories, out_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) weights, zero biases (the reference's init)."""
        nn.init.normal_(self.weight, std=0.02)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        return category_linear(x, self.weight, self.bias, ids, self.impl)


class CategorySpecificMLP(nn.Module):
    """``layer2(relu(layer1(x)))`` with per-embodiment weights."""

    def __init__(
        self,
        num_categories: int,
        in_dim: int,
        hidden: int,
        out_dim: int,
        impl: CategoryImpl = "bmm",
    ) -> None:
        super().__init__()
        self.layer1 = CategorySpecificLinear(num_categories, in_dim, hidden, impl)
        self.layer2 = CategorySpecificLinear(num_categories, hidden, out_dim, impl)

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        return self.layer2(torch.relu(self.layer1(x, ids)), ids)
