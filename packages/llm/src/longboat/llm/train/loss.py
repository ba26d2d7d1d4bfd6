"""The LM loss of a training step: fused linear cross-entropy or megatron's logits path.

megatron's ``GPTModel`` computes ``[tokens, vocab]`` logits with its output layer and then a
per-token cross-entropy (fp32 upcast of the logits). With a 32k vocabulary at 16k tokens per
microbatch that is ~1 GB of bf16 logits plus their fp32 copy and gradient. The fused path
hands ``GPTModel``'s ``output_processor`` hook ``fused_lm_loss``: the final-norm hidden states
and the output weight go straight to ``longboat.kernels.fused_linear_ce`` (chunked logits,
loss and gradients in one pass; no full logits). It returns the mean cross-entropy over the
tokens ``loss_mask`` keeps, the same quantity as ``masked_lm_loss`` on the logits path.

The output layer is vocab-parallel under tensor parallelism (each rank holds a vocab
shard) and sequence-parallel / context-parallel runs split the tokens, so the fused path is
used only without them (``fused_loss_applies``); otherwise the logits path runs.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100


def fused_lm_loss(
    *,
    hidden_states: torch.Tensor,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor,
    context: torch.Tensor | None = None,
    **unused: Any,
) -> torch.Tensor:
    """``GPTModel`` ``output_processor``: mean CE of ``hidden @ W_out.T`` against ``labels``.

    ``hidden_states`` ``[s, b, h]`` (megatron's layout), ``labels`` ``[b, s]``; ``context``
    (``output_processor_context``) is the ``[b, s]`` loss mask (0 / 1) or None for all tokens.
    Returns an fp32 scalar.
    """
    from longboat.kernels.fused_linear_ce import fused_linear_cross_entropy

    weight = output_weight if output_weight is not None else output_layer.weight
    target = labels
    if context is not None:
        target = labels.masked_fill(context == 0, IGNORE_INDEX)
    # [b, s] -> [s, b] to match hidden's token order (a view; the kernel reads it flat).
    return fused_linear_cross_entropy(
        hidden_states, weight, target.t().contiguous(), ignore_index=IGNORE_INDEX
    )


def fused_loss_applies(model: torch.nn.Module) -> bool:
    """True when ``fused_lm_loss`` computes the full-vocab loss of ``model`` on this rank.

    Needs the whole vocabulary and all of the microbatch's tokens here: tensor parallel 1
    (no vocab shards), no sequence / context parallelism, no multi-token prediction, no
    logit scaling (muP), and the output layer on this stage (pipeline last stage).
    """
    inner = model
    while hasattr(inner, "module") and not hasattr(inner, "output_layer"):
        inner = inner.module
    cfg = getattr(inner, "config", None)
    if cfg is None or not getattr(inner, "post_process", False):
        return False
    return (
        cfg.tensor_model_parallel_size == 1
        and cfg.context_parallel_size == 1
        and not cfg.sequence_parallel
        and not getattr(cfg, "mtp_num_layers", None)
        and not getattr(cfg, "use_mup", False)
    )
