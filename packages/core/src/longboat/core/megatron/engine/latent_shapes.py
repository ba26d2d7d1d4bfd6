"""The memory plan's shapes of a multi-head latent attention decoder (DeepSeek-V3, Moonlight,
Kimi K2, DeepSeek-V3.2): ``LatentDecoderShapes``, a ``DecoderShapes`` whose layers are MLA
(low-rank q and kv, the decoupled rotary key) over a dense SwiGLU (the first
``first_k_dense`` layers) or DeepSeekMoE (shared experts beside the routed ones, sigmoid
routing, optional expert groups), optional multi-token prediction layers on the last stage,
and DeepSeek-V3.2's sparse attention (the lightning indexer and attention over its
``index_topk`` keys) when ``index_topk`` is set. ``estimate_decoder_peak`` and the chooser
take it as they take the GQA shapes.

Per layer the plan counts what the llm stack's MLA layers save for the backward on the
longboat layer kernels:

- dense MLA (megatron's ``MLASelfAttention``): the normed input of the q and kv down
  projections, the q latent before and after its norm (with ``q_lora_rank``), the kv down
  projection's output and its normed latent, four rotary tables, and the flash attention's
  q, k, v and output at the query/key head width (values are zero-padded to it) with the
  output cut back to the value width as a copy, plus the log-sum-exp; selective recompute
  keeps the core attention's inputs (values unpadded) and its cut output;
- sparse MLA (megatron's absorbed ``MLASelfAttention`` over DSA): the path of
  ``longboat.kernels.dsa`` that CUDA devices run (and Triton's interpreter): the q up
  projection's output (its no-rope part is absorbed into the latent space), the absorbed
  query ``[tokens, heads, kv_lora_rank + rope]`` and the one latent key, the indexer's top-k
  indices (int64), the sparse attention's output (which the value up projection, a batched
  matmul over heads, saves as its input: the kernel writes it head-major, so it is one
  tensor) and log-sum-exp, and that projection's output; the indexer itself runs without
  grad and saves nothing (``index_loss_coeff`` = 0; its KL loss path is not estimated).
  Megatron's dense masked reference, which other devices run, is not what is planned;
- the MLP: a dense SwiGLU as the GQA layer's; DeepSeekMoE's shared experts as a SwiGLU, the
  router's fp32 scores, top-k, argsort and permutation maps, the grouped experts' dispatched
  tokens, gate/up output, SwiGLU output and its probability-scaled copy;
- multi-token prediction (each depth, last stage): its two input norms, the ``eh``
  projection's input, one MoE layer, its final norm and a loss over megatron's logits path
  (fp32 ``[tokens, vocab]``).

The backward's working set adds the attention's gradients (the sparse kernel's dq in the
weights' dtype, accumulated in registers, and its fp32 dk, into which the value's gradient
is added since the value is the key's latent prefix, beside its cast), counted over what is still saved when they exist (the
layer's MLP activations are freed by then), and, with sparse attention, the indexer's
forward working set: its fp32 scores of one chunk of queries (``DSA_CHUNK_ELEMENTS`` at
most) and that chunk's top-k temporaries, which the forward (and a recomputed forward)
holds for one layer while choosing its keys. The routers' expert-bias and token-count buffers (fp32, two per MoE
layer of ``experts`` elements) are buffers, not parameters: no gradient or optimizer state,
a few kilobytes a layer; they are not counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from longboat.core.megatron.engine.memory_plan import DecoderShapes

DSA_CHUNK_ELEMENTS = 1 << 27
"""fp32 elements of the chunks the DSA kernels work in (``longboat.kernels.dsa``'s
``CHUNK_ELEMENTS``, which core does not import; a test holds the two equal): the indexer's
fp32 scores of one chunk of queries."""


@dataclass(frozen=True, kw_only=True)
class LatentDecoderShapes(DecoderShapes):
    """A multi-head latent attention decoder's shapes on one rank (module doc). The base's
    ``head_dim`` is the query/key head width ``qk_nope_head_dim + qk_rope_head_dim``,
    ``ffn`` the dense layers' SwiGLU width, ``expert_ffn`` one routed expert's."""

    q_lora_rank: int | None
    """Rank of the query's low-rank projection (None: one q projection)."""
    kv_lora_rank: int
    """Rank of the shared key/value latent."""
    qk_nope_head_dim: int
    """Per-head query/key width without rotary."""
    qk_rope_head_dim: int
    """Rotary query/key width (the rotary key is one head shared by all)."""
    v_head_dim: int
    """Per-head value width."""
    first_k_dense: int = 0
    """Leading layers with a dense SwiGLU (the rest are MoE)."""
    shared_ffn: int = 0
    """Width of the shared experts' one SwiGLU (0: none)."""
    router_groups: int = 1
    """Expert groups of group-limited routing (1: none)."""
    router_group_topk: int = 1
    """Groups a token may route into."""
    mtp_layers: int = 0
    """Multi-token prediction depths (last stage)."""
    index_topk: int | None = None
    """Keys a query attends to with DeepSeek-V3.2's sparse attention (None: dense MLA)."""
    index_heads: int = 0
    """Heads of the lightning indexer."""
    index_head_dim: int = 0
    """Per-head width of the lightning indexer."""

    @classmethod
    def of(cls, cfg: Any, **kwargs: Any) -> LatentDecoderShapes:  # type: ignore[override]
        """The shapes of ``cfg`` (a DeepSeek-V3 style config: ``kv_lora_rank``,
        ``first_k_dense``, ``num_shared_experts`` ...); keywords as ``DecoderShapes.of``."""
        base = DecoderShapes.of(cfg, **kwargs)
        sparse = getattr(cfg, "index_topk", None) is not None
        groups = int(getattr(cfg, "moe_router_num_groups", 1) or 1)
        return cls(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(DecoderShapes)},
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            first_k_dense=cfg.first_k_dense,
            shared_ffn=int(getattr(cfg, "num_shared_experts", 0) or 0) * base.expert_ffn,
            router_groups=groups,
            router_group_topk=int(getattr(cfg, "moe_router_group_topk", 1)) if groups > 1 else 1,
            mtp_layers=int(getattr(cfg, "mtp_num_layers", 0) or 0),
            index_topk=cfg.index_topk if sparse else None,
            index_heads=cfg.index_n_heads if sparse else 0,
            index_head_dim=cfg.index_head_dim if sparse else 0,
        )

    # --- parameters ---------------------------------------------------------------------

    def attention_params(self) -> int:
        """MLA's parameters on this rank: the q projection(s) and the q latent's norm, the kv
        down projection, the kv latent's norm, the kv up projection, the output projection
        (the down projections are megatron column-parallel linears, sharded like the up
        ones) and, with sparse attention, the lightning indexer (held whole on every rank:
        ``wq_b``, ``wk``, its key's LayerNorm, ``weights_proj``)."""
        h, tp, a = self.hidden, self.tensor_parallel, self.heads
        qk, r, kv = (
            self.qk_nope_head_dim + self.qk_rope_head_dim,
            self.q_lora_rank,
            self.kv_lora_rank,
        )
        if r is None:
            n = a * qk // tp * h
        else:
            n = r // tp * h + r + a * qk // tp * r
        n += (kv + self.qk_rope_head_dim) // tp * h + kv
        n += a * (self.qk_nope_head_dim + self.v_head_dim) // tp * kv
        n += a * self.v_head_dim // tp * h
        if self.index_topk is not None:
            d, heads = self.index_head_dim, self.index_heads
            n += (r or h) * heads * d + h * d + 2 * d + h * heads
        return n

    def moe_mlp_params(self) -> int:
        """A DeepSeekMoE MLP's parameters on this rank: router, this rank's routed experts,
        the shared experts."""
        h, local = self.hidden, self.experts // self.expert_parallel
        return (
            self.experts * h
            + local * 3 * self.expert_ffn * h
            + 3 * self.shared_ffn // self.tensor_parallel * h
        )

    def layer_params(self, dense: bool = False) -> int:  # type: ignore[override]
        """One decoder layer's parameters on this rank: two norms, MLA, and the dense SwiGLU
        (``dense``) or the MoE MLP."""
        mlp = 3 * self.ffn // self.tensor_parallel * self.hidden if dense else self.moe_mlp_params()
        return 2 * self.hidden + self.attention_params() + mlp

    def mtp_params(self) -> int:
        """One multi-token prediction depth's parameters: an MoE layer, the ``eh`` projection
        (column-parallel) and its three norms (``enorm``, ``hnorm``, the final one)."""
        h = self.hidden
        return self.layer_params() + 2 * h // self.tensor_parallel * h + 3 * h

    def _stage_layers(self, stage: int) -> tuple[int, int]:
        """(dense, MoE) layers of pipeline stage ``stage`` (megatron's even split, the dense
        layers first)."""
        per = self.layers // self.pipeline_parallel
        first = stage * per
        dense = max(0, min(self.first_k_dense, first + per) - first)
        return dense, per - dense

    def stage_params(self, stage: int = 0) -> int:
        """Parameters of pipeline stage ``stage``'s chunk on one rank: its dense and MoE
        layers, the embedding (first stage), and on the last the final norm, the output
        layer and the multi-token prediction depths (which keep their own embedding copy
        where the last stage is not the first)."""
        pp = self.pipeline_parallel
        first, last = stage == 0, stage == pp - 1
        dense, moe = self._stage_layers(stage)
        embedding = self.vocab // self.tensor_parallel * self.hidden
        n = dense * self.layer_params(dense=True) + moe * self.layer_params()
        n += embedding if first else 0
        if last:
            n += self.hidden
            n += embedding if not (self.tie_embeddings and first) else 0
            n += self.mtp_layers * self.mtp_params()
            n += embedding if self.mtp_layers and not first else 0
        return n

    # --- activations --------------------------------------------------------------------

    def _keys(self) -> int:
        """Keys a query attends to with sparse attention (the top-k, at most the sequence)."""
        assert self.index_topk is not None
        return min(self.index_topk, self.seq_len // self.context_parallel)

    def attention_saved(self, micro_batch: int, recompute: str) -> int:
        """Bytes MLA saves for its backward, from its normed input on (module doc)."""
        t, e, tp = self._tokens(micro_batch), self.weight_bytes, self.tensor_parallel
        a, r, kv = self.heads // tp, self.q_lora_rank, self.kv_lora_rank
        qk, rope, dv = (
            self.qk_nope_head_dim + self.qk_rope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        )
        n = e * t * self.hidden  # the normed input of the down projections
        if r is not None:  # the q latent, its rstd and its normed copy
            n += 2 * e * t * r + 4 * t
        n += e * t * (kv + rope) + 4 * t  # the kv down projection's output, the latent's rstd
        n += 4 * e * (self.seq_len // self.context_parallel) * rope  # rotary tables
        n += e * t * a * dv  # the output projection's input
        if self.index_topk is not None:  # the absorbed query, the latent key, the q up output
            n += e * t * a * (kv + rope) + e * t * (kv + rope) + e * t * a * qk
            if recompute != "selective":  # indices; the output (the v up's input), lse
                n += 8 * t * self._keys() + e * t * a * kv + 4 * t * a
            return n
        n += e * t * kv  # the normed kv latent
        if recompute == "selective":  # the core attention's inputs, values unpadded
            return n + 2 * e * t * a * qk + e * t * a * dv
        width = max(qk, dv)
        n += 4 * e * t * a * width + 4 * t * a  # q, k, padded v, padded output; lse
        return n - (e * t * a * dv if dv == width else 0)  # unpadded: the output itself

    def mlp_saved(self, micro_batch: int, dense: bool) -> int:
        """Bytes the MLP saves from its normed input on (module doc)."""
        t, e, h, tp = (
            self._tokens(micro_batch),
            self.weight_bytes,
            self.hidden,
            self.tensor_parallel,
        )
        n = e * t * h
        if dense:
            return n + e * t * 3 * self.ffn // tp
        k, f, experts = self.topk, self.expert_ffn, self.experts
        n += e * t * 3 * self.shared_ffn // tp
        # fp32 scores, int64 argsort over (token, expert); top-k indices and probabilities,
        # their permuted copies and maps
        n += t * (12 * experts + 32 * k + 4)
        if self.router_groups > 1:  # the group mask, the groups' scores' top-k and choice
            n += t * (experts + 16 * self.router_groups + 8 * self.router_group_topk)
        return n + e * t * k * (h + 4 * f)

    def layer_saved(self, micro_batch: int, recompute: str, dense: bool = False) -> int:  # type: ignore[override]
        """Bytes one layer (``dense``: a dense-MLP one) saves for its backward."""
        t, e, tp = self._tokens(micro_batch), self.weight_bytes, self.tensor_parallel
        rows = t // (tp if self.sequence_parallel else 1)
        stream = e * rows * self.hidden
        if recompute == "full":
            return stream
        n = 2 * stream + 2 * 4 * rows  # the two norms' inputs and rstds
        return n + self.attention_saved(micro_batch, recompute) + self.mlp_saved(micro_batch, dense)

    def mtp_saved(self, micro_batch: int, recompute: str) -> int:
        """Bytes one multi-token prediction depth saves: the shifted tokens, its two input
        norms, the ``eh`` projection's input, an MoE layer (under ``recompute``), its final
        norm and output, and the loss over megatron's logits (fp32 softmax, mask, targets);
        under full recompute the depth keeps only its tokens, its two inputs and its output
        before the loss."""
        t, e, h = self._tokens(micro_batch), self.weight_bytes, self.hidden
        loss = 4 * t * (self.vocab // self.tensor_parallel) + 21 * t
        if recompute == "full":
            return 8 * t + 4 * e * t * h + loss
        n = 8 * t + 2 * (e * t * h + 4 * t) + 2 * e * t * h
        n += self.layer_saved(micro_batch, recompute)
        return n + (e * t * h + 4 * t) + 2 * e * t * h + loss

    def stage_saved(
        self, stage: int, micro_batch: int, recompute: str, full_layers: int | None = None
    ) -> int:
        """Bytes stage ``stage``'s layers save for one microbatch (with full recompute and
        ``full_layers``, only the first that many layers recompute, the rest keep everything),
        plus the multi-token prediction depths on the last stage (under ``recompute``)."""
        dense, moe = self._stage_layers(stage)
        layers = dense + moe
        redo = layers if recompute != "full" or full_layers is None else min(full_layers, layers)
        n = 0
        for i in range(dense + moe):
            n += self.layer_saved(micro_batch, recompute if i < redo else "none", dense=i < dense)
        if stage == self.pipeline_parallel - 1:
            n += self.mtp_layers * self.mtp_saved(micro_batch, recompute)
        return n

    def head_transient(self, micro_batch: int) -> int:
        """The main loss's transient, or a multi-token prediction depth's bf16 logits."""
        n = super().head_transient(micro_batch)
        if self.mtp_layers:
            v = self.vocab // self.tensor_parallel
            n = max(n, self.weight_bytes * self._tokens(micro_batch) * v)
        return n

    def indexer_transient(self, micro_batch: int) -> int:
        """The lightning indexer's forward working set (sparse attention): its query heads,
        and for one chunk of queries (``DSA_CHUNK_ELEMENTS`` fp32 scores at most) the fp32
        scores over the keys, the top-k values (fp32) and indices (int64), the indices with
        ``-1`` filled in and the fill mask."""
        if self.index_topk is None:
            return 0
        t, s = self._tokens(micro_batch), self.seq_len // self.context_parallel
        rows = min(t, max(1, DSA_CHUNK_ELEMENTS // s))
        return (
            4 * rows * s
            + 21 * rows * self._keys()
            + self.weight_bytes * t * self.index_heads * self.index_head_dim
        )

    def attention_backward(self, micro_batch: int, recompute: str) -> int:
        """The attention's backward working set: the gradient of its output and its kernel's
        gradients (sparse: dq in the weights' dtype, the fp32 dk holding the value's
        gradient too, and its cast; dense: flash attention's dq / dk / dv at the padded
        width), plus, with selective
        recompute, what the recomputed core attention holds again (sparse: the indices, the
        output and its log-sum-exp; dense: the padded output, its cut copy and the
        log-sum-exp)."""
        t, e, a = self._tokens(micro_batch), self.weight_bytes, self.heads // self.tensor_parallel
        kv = self.kv_lora_rank
        if self.index_topk is not None:
            latent = kv + self.qk_rope_head_dim
            n = e * t * a * kv + e * t * a * latent + (4 + e) * t * latent
            if recompute == "selective":
                n += 8 * t * self._keys() + e * t * a * kv + 4 * t * a
            return n
        width = max(self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim)
        n = 4 * e * t * a * width
        if recompute == "selective":
            n += e * t * a * (width + self.v_head_dim) + 4 * t * a
        return n

    def backward_workspace(self, micro_batch: int, recompute: str) -> int:
        """The backward's working set in one layer, the largest of: the MLP's (the gradients
        of its largest activations), the attention's (``attention_backward``) less the MLP's
        saved activations (freed when the attention's backward runs), and the indexer's
        forward working set; with full recompute the layer's own activations are brought
        back first (the largest layer's, dense or MoE)."""
        t, e, h = self._tokens(micro_batch), self.weight_bytes, self.hidden
        rows = t // (self.tensor_parallel if self.sequence_parallel else 1)
        attn = 2 * e * t * h + self.attention_backward(micro_batch, recompute)
        moe_layers = self.layers - self.first_k_dense
        kinds = [d for d, present in ((True, self.first_k_dense), (False, moe_layers))
                 if present]  # fmt: skip
        n = self.indexer_transient(micro_batch)
        for dense in kinds:
            if dense:
                width = 3 * self.ffn // self.tensor_parallel
            else:
                width = self.topk * (3 * self.expert_ffn + h) + 3 * self.shared_ffn
            mlp = 2 * e * t * h + e * t * width
            freed = self.mlp_saved(micro_batch, dense) + e * rows * h + 4 * rows
            back = self.layer_saved(micro_batch, "none", dense=dense) if recompute == "full" else 0
            n = max(n, back + mlp, back + attn - freed)
        return n


def is_latent_attention(cfg: Any) -> bool:
    """Whether ``cfg`` is a multi-head latent attention decoder (it has ``kv_lora_rank``)."""
    return getattr(cfg, "kv_lora_rank", None) is not None


__all__ = ["DSA_CHUNK_ELEMENTS", "LatentDecoderShapes", "is_latent_attention"]
