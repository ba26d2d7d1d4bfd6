"""DeepSeek-V3.2's sparse attention on longboat's DSA kernels.

``KernelDSAttention`` is megatron's ``DSAttention`` whose common case (the absorbed MLA
layout, one causal sequence per sample, no context or sequence parallelism, every layer
choosing its own keys) runs on ``longboat.kernels.dsa``: the lightning-indexer kernel picks
the keys (in chunks of queries, never holding the whole ``[b, s, s]`` index scores) and the
Triton sparse attention attends them (forward and backward), never forming the
``[b, heads, s, s]`` score matrix; the value up projection is a batched matmul over heads
that reads the attention's head-major output in place (it saves no copy of it). With the indexer's KL loss on
(``index_loss_coeff`` > 0 while training), the keys and the loss come from megatron's
reference indexer-loss path (it needs the dense indexer and attention distributions) and only
the attention runs on the kernel. Where the Triton kernels cannot run (CPU tensors outside
Triton's interpreter) or the case is not the common one, megatron's path runs, with a
one-line notice per reason.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

_LOG = logging.getLogger(__name__)
_NOTICED: set[str] = set()


def _notice(reason: str) -> None:
    if reason not in _NOTICED:
        _NOTICED.add(reason)
        _LOG.info("DeepSeek-V3.2 sparse attention: megatron's path (%s)", reason)


def _causal_bounds(sq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's varlen form of the plain causal mask: query ``i`` sees keys ``[0, i]``."""
    ends = torch.arange(1, sq + 1, dtype=torch.int64, device=device)
    return torch.zeros_like(ends), ends


@functools.cache
def kernel_dsattention() -> type:
    """The ``DSAttention`` subclass on longboat's kernels (built lazily: megatron is an
    optional dependency of the package)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossAutoScaler,
        DSAIndexerLossLoggingHelper,
        DSAttention,
        FusedDSAIndexerLoss,
    )
    from megatron.core.utils import get_pg_size

    from longboat.kernels.dsa import indexer_topk, runs_triton, sparse_attention

    class KernelDSAttention(DSAttention):
        """megatron's ``DSAttention`` with the indexer and sparse attention on longboat's
        Triton kernels where they apply (module docstring)."""

        cuda_graph_blocker = (
            "DeepSeek-V3.2's sparse attention (its step is not recorded as a CUDA graph: the "
            "capture fails with unjoined stream work; at the sequence lengths it serves the "
            "step is bound by compute, not launches)"
        )
        """Read by the engine's graph check: the step runs eagerly (``train.cuda_graph=true``
        is refused with this reason)."""

        def _declines(self, query: torch.Tensor, key: torch.Tensor, value: Any,
                      packed_seq_params: Any, attn_mask_type: Any,
                      up_v_weight: Any) -> str | None:  # fmt: skip
            """Why the kernels do not apply to this call, or None when they do."""
            if not runs_triton(query, key):
                return f"the Triton kernels do not run on {query.device.type} tensors here"
            if packed_seq_params is not None:
                return "packed sequences"
            cp = get_pg_size(getattr(self.pg_collection, "cp", None))
            tp = get_pg_size(getattr(self.pg_collection, "tp", None))
            if cp > 1 or (self.config.sequence_parallel and tp > 1):
                return "context or sequence parallelism"
            if self.index_share:
                return "top-k shared across layers"
            if attn_mask_type != AttnMaskType.causal:
                return "a mask other than causal"
            if (
                value is not None
                or up_v_weight is None
                or query.dim() != 4
                or key.dim() != 4
                or key.size(2) != 1
                or key.size(0) != query.size(0)
            ):
                return "not the absorbed MLA layout"
            return None

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: Any,
                    attention_mask: Any, x: torch.Tensor, qr: torch.Tensor,
                    position_ids: Any = None, attn_mask_type: Any = None,
                    attention_bias: Any = None, packed_seq_params: Any = None,
                    up_v_weight: Any = None) -> torch.Tensor:  # fmt: skip
            reason = self._declines(query, key, value, packed_seq_params, attn_mask_type,
                                    up_v_weight)  # fmt: skip
            if reason is not None:
                _notice(reason)
                return super().forward(
                    query, key, value, attention_mask, x, qr, position_ids=position_ids,
                    attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                    packed_seq_params=packed_seq_params, up_v_weight=up_v_weight,
                )  # fmt: skip
            return self._kernel_forward(query, key, x, qr, up_v_weight)

        def _kernel_forward(self, query: torch.Tensor, key: torch.Tensor, x: torch.Tensor,
                            qr: torch.Tensor, up_v_weight: torch.Tensor) -> torch.Tensor:  # fmt: skip
            sq, b = query.shape[:2]
            config = self.config
            coeff = config.dsa_indexer_loss_coeff or 0.0
            use_loss = self.training and torch.is_grad_enabled() and coeff > 0
            relu = config.dsa_indexer_scoring_relu
            # The indexer reads detached inputs: its only gradient is its own loss's.
            with torch.enable_grad() if use_loss else torch.no_grad():
                q, k, weights = self.indexer.forward_before_topk(x.detach(), qr.detach(), None)
            loss = None
            if use_loss:
                starts, ends = _causal_bounds(sq, query.device)
                key_for_loss = key.detach().expand(-1, -1, query.size(2), -1)
                indices, loss = FusedDSAIndexerLoss.apply(
                    q, weights, k, query.detach(), key_for_loss, self.softmax_scale,
                    self.index_topk, coeff, None, config.dsa_indexer_use_sparse_loss,
                    self.pg_collection, starts, ends, None, None,
                    config.calculate_per_token_loss, relu,
                )  # fmt: skip
                DSAIndexerLossLoggingHelper.save_loss_to_tracker(
                    loss=loss, layer_number=self.layer_number, num_layers=config.num_layers,
                    reduce_group=None, avg_group=None,
                )  # fmt: skip
            else:
                indices = indexer_topk(
                    q.transpose(0, 1), k.transpose(0, 1), weights.transpose(0, 1),
                    self.index_topk, relu=relu,
                )  # fmt: skip
            # [s, b, 1, latent + rope] -> [b, s, latent + rope]; the value is the latent.
            latent = key[:, :, 0].transpose(0, 1)
            out = sparse_attention(
                query.transpose(0, 1), latent, latent[..., : config.kv_lora_rank], indices,
                self.softmax_scale,
            )  # fmt: skip
            # [b, s, h, latent] over a head-major buffer: [h, b * s, latent] is a view, and
            # the matmul saves it, not a copy; [h, b * s, v] -> [s, b, h * v]
            heads = out.size(2)
            up_v = up_v_weight.to(device=query.device, dtype=query.dtype)
            per_head = out.permute(2, 0, 1, 3).reshape(heads, b * sq, -1)
            values = torch.bmm(per_head, up_v.transpose(1, 2))
            output = values.view(heads, b, sq, -1).permute(2, 1, 0, 3).reshape(sq, b, -1)
            if loss is not None:
                output = DSAIndexerLossAutoScaler.apply(output, loss)
            return output

    return KernelDSAttention


__all__ = ["kernel_dsattention"]
