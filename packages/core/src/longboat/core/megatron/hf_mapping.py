"""Megatron <-> Hugging Face tensor mapping for Llama-style decoder blocks.

Each megatron parameter name maps to one ``Slot``: the HF tensor names it is
made of and how it is split across tensor-parallel ranks (``kind``):

* ``replicated``: same tensor on every TP rank (norms, router);
* ``column``: rows split (vocab embedding, output head);
* ``row``: columns split (attention output, MLP down projection);
* ``qkv``: q/k/v rows of this rank's query groups, interleaved per group as
  megatron's fused ``linear_qkv`` stores them;
* ``gate_up``: this rank's gate rows followed by its up rows (``linear_fc1``).

Experts are not TP-split (expert tensor parallel is 1): ``local_experts.j`` of
expert-parallel rank ``r`` is HF expert ``r * num_local_experts + j``. Grouped experts
(``grouped_experts.GroupedExperts``) stack a rank's local experts in one tensor:
``expert_stack_gate_up`` (``[E, 2F, H]``, each expert's gate rows then up rows) and
``expert_stack_full`` (``[E, H, F]``), their HF names expert by expert.

Two HF layouts of the experts (``expert_layout``): ``per_expert`` (``mlp.experts.<e>.
{gate,up,down}_proj.weight``, Qwen3-MoE / Mixtral files) and ``fused`` (one
``mlp.experts.gate_up_proj`` and one ``mlp.experts.down_proj`` tensor a layer, Qwen3-VL-MoE
files). A fused tensor is read in either orientation: transformers' own (``[E, 2F, H]``,
``[E, H, F]``: each expert's gate rows then up rows, as megatron stores them) or the
released checkpoints' (``[E, H, 2F]``, ``[E, F, H]``); where the two shapes are equal
(square experts) it is transformers' own, as transformers reads it. Exports write the
released orientation except where it is ambiguous (``fused_experts_for_file``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from longboat.core.megatron.decoder_config import DecoderModelConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")
_STACKED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight$")

EXPERT_LAYOUTS = ("per_expert", "fused")
"""How an HF checkpoint stores a layer's routed experts (see the module doc)."""
FUSED_EXPERT_NAMES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""The fused layout's two tensors of a layer (after ``<prefix>layers.<i>.``)."""


@dataclass(frozen=True)
class Slot:
    """How one megatron tensor is made of HF tensors."""

    kind: str
    hf_names: tuple[str, ...]
    experts: tuple[int, ...] = ()
    """Fused expert kinds: the global expert indices the megatron tensor holds, in order."""
    stacked: bool = False
    """Fused expert kinds: the megatron tensor stacks ``experts`` (``[n, ...]``) rather than
    holding one expert."""


@dataclass(frozen=True)
class RankCoords:
    """Where this rank sits in the parallel layout."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


def megatron_to_hf_slot(
    name: str,
    arch: DecoderModelConfig,
    *,
    global_layer: int | None,
    ep: RankCoords,
    prefix: str = "model.",
    expert_layout: str = "per_expert",
) -> Slot:
    """The ``Slot`` of megatron parameter ``name`` (``global_layer`` for decoder layers);
    ``expert_layout``: one of ``EXPERT_LAYOUTS``."""
    if name == "embedding.word_embeddings.weight":
        return Slot("column", (f"{prefix}embed_tokens.weight",))
    if name == "decoder.final_layernorm.weight":
        return Slot("replicated", (f"{prefix}norm.weight",))
    if name == "output_layer.weight":
        head = f"{prefix}embed_tokens.weight" if arch.tie_embeddings else "lm_head.weight"
        return Slot("column", (head,))
    m = _LAYER.match(name)
    if m is None or global_layer is None:
        raise KeyError(name)
    rest = m.group(2)
    hf = f"{prefix}layers.{global_layer}."
    attn = hf + "self_attn."
    simple = {
        "input_layernorm.weight": Slot("replicated", (hf + "input_layernorm.weight",)),
        "self_attention.linear_qkv.layer_norm_weight": Slot(
            "replicated", (hf + "input_layernorm.weight",)
        ),
        "pre_mlp_layernorm.weight": Slot("replicated", (hf + "post_attention_layernorm.weight",)),
        "mlp.linear_fc1.layer_norm_weight": Slot(
            "replicated", (hf + "post_attention_layernorm.weight",)
        ),
        "self_attention.linear_qkv.weight": Slot(
            "qkv", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")
        ),
        "self_attention.linear_qkv.bias": Slot(
            "qkv", (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias")
        ),
        "self_attention.q_layernorm.weight": Slot("replicated", (attn + "q_norm.weight",)),
        "self_attention.k_layernorm.weight": Slot("replicated", (attn + "k_norm.weight",)),
        "self_attention.linear_proj.weight": Slot("row", (attn + "o_proj.weight",)),
        "mlp.linear_fc1.weight": Slot(
            "gate_up", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
        ),
        "mlp.linear_fc2.weight": Slot("row", (hf + "mlp.down_proj.weight",)),
        "mlp.router.weight": Slot("replicated", (hf + "mlp.gate.weight",)),
    }
    if rest in simple:
        return simple[rest]
    sm = _STACKED_EXPERT.match(rest)
    if sm is not None and expert_layout == "fused":
        local = arch.num_experts // ep.ep_size
        return _fused_slot(hf, sm.group(1), range(ep.ep_rank * local, (ep.ep_rank + 1) * local))
    if sm is not None:
        local = arch.num_experts // ep.ep_size
        experts = [f"{hf}mlp.experts.{ep.ep_rank * local + j}." for j in range(local)]
        if sm.group(1) == "linear_fc1":
            names = [ex + p for ex in experts for p in ("gate_proj.weight", "up_proj.weight")]
            return Slot("expert_stack_gate_up", tuple(names))
        return Slot("expert_stack_full", tuple(ex + "down_proj.weight" for ex in experts))
    em = _LOCAL_EXPERT.match(rest) or _GROUPED_EXPERT.match(rest)
    if em is not None:
        if em.re is _LOCAL_EXPERT:
            local, which = int(em.group(1)), em.group(2)
        else:
            which, local = em.group(1), int(em.group(2))
        expert = ep.ep_rank * (arch.num_experts // ep.ep_size) + local
        if expert_layout == "fused":
            return _fused_slot(hf, which, range(expert, expert + 1), stacked=False)
        ex = f"{hf}mlp.experts.{expert}."
        if which == "linear_fc1":
            return Slot("expert_gate_up", (ex + "gate_proj.weight", ex + "up_proj.weight"))
        return Slot("expert_full", (ex + "down_proj.weight",))
    raise KeyError(name)


def _fused_slot(hf: str, which: str, experts: range, *, stacked: bool = True) -> Slot:
    """The fused-layout slot of one megatron expert tensor (``linear_fc1`` / ``linear_fc2``)."""
    if which == "linear_fc1":
        return Slot("expert_fused_gate_up", (hf + FUSED_EXPERT_NAMES[0],), tuple(experts), stacked)
    return Slot("expert_fused_down", (hf + FUSED_EXPERT_NAMES[1],), tuple(experts), stacked)


def fused_experts_from_file(t: torch.Tensor, per_expert: tuple[int, int]) -> torch.Tensor:
    """``[n, *per_expert]`` experts (megatron's orientation) of a fused checkpoint tensor's
    rows ``t``, which may hold them transposed (the released orientation)."""
    if tuple(t.shape[1:]) != tuple(per_expert) and tuple(t.shape[1:]) == tuple(per_expert[::-1]):
        return t.transpose(1, 2)
    return t


def fused_experts_for_file(t: torch.Tensor) -> torch.Tensor:
    """The released orientation of a fused ``[E, a, b]`` expert tensor (megatron's
    orientation), unless ``a == b``: then both read alike and transformers reads its own."""
    return t if t.shape[1] == t.shape[2] else t.transpose(1, 2).contiguous()


def expected_hf_shapes(
    arch: DecoderModelConfig, *, prefix: str = "model.", expert_layout: str = "per_expert"
) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of ``arch`` holds, with its shape (fused experts in
    megatron's orientation; ``fused_experts_from_file`` reads the other)."""
    h, d, v = arch.hidden_size, arch.head_dim, arch.vocab_size
    nq, nkv = arch.num_attention_heads * d, arch.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}embed_tokens.weight": (v, h),
        f"{prefix}norm.weight": (h,),
    }
    if not arch.tie_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(arch.num_layers):
        hf = f"{prefix}layers.{i}."
        shapes[hf + "input_layernorm.weight"] = (h,)
        shapes[hf + "post_attention_layernorm.weight"] = (h,)
        shapes[hf + "self_attn.q_proj.weight"] = (nq, h)
        shapes[hf + "self_attn.k_proj.weight"] = (nkv, h)
        shapes[hf + "self_attn.v_proj.weight"] = (nkv, h)
        shapes[hf + "self_attn.o_proj.weight"] = (h, nq)
        if arch.attention_bias:
            shapes[hf + "self_attn.q_proj.bias"] = (nq,)
            shapes[hf + "self_attn.k_proj.bias"] = (nkv,)
            shapes[hf + "self_attn.v_proj.bias"] = (nkv,)
        if arch.qk_norm:
            shapes[hf + "self_attn.q_norm.weight"] = (d,)
            shapes[hf + "self_attn.k_norm.weight"] = (d,)
        if arch.num_experts:
            f = int(arch.moe_ffn_hidden_size or 0)
            shapes[hf + "mlp.gate.weight"] = (arch.num_experts, h)
            if expert_layout == "fused":
                shapes[hf + FUSED_EXPERT_NAMES[0]] = (arch.num_experts, 2 * f, h)
                shapes[hf + FUSED_EXPERT_NAMES[1]] = (arch.num_experts, h, f)
                continue
            for e in range(arch.num_experts):
                ex = hf + f"mlp.experts.{e}."
                shapes[ex + "gate_proj.weight"] = (f, h)
                shapes[ex + "up_proj.weight"] = (f, h)
                shapes[ex + "down_proj.weight"] = (h, f)
        else:
            f = arch.ffn_hidden_size
            shapes[hf + "mlp.gate_proj.weight"] = (f, h)
            shapes[hf + "mlp.up_proj.weight"] = (f, h)
            shapes[hf + "mlp.down_proj.weight"] = (h, f)
    return shapes


# -- TP sharding --------------------------------------------------------------------------


def _rows(n: int, coords: RankCoords) -> slice:
    per = n // coords.tp_size
    return slice(coords.tp_rank * per, (coords.tp_rank + 1) * per)


def shard_from_hf(
    slot: Slot, read: Callable[..., torch.Tensor], arch: DecoderModelConfig, coords: RankCoords
) -> torch.Tensor:
    """Build this rank's megatron tensor from HF data.

    ``read(name, rows, cols)`` returns ``tensor[rows, cols]`` of one HF tensor (reading only
    that part from disk); ``cols == "tp"`` means this TP rank's share of the columns.
    """
    full = slice(None)
    kind = slot.kind
    if kind == "replicated" or kind == "expert_full":
        return read(slot.hf_names[0], full, full)
    if kind == "column":
        return read(slot.hf_names[0], _rows(arch.vocab_size, coords), full)
    if kind == "row":
        # dim 1 is split; the shard width is the per-rank share of the input features.
        return read(slot.hf_names[0], full, "tp")
    if kind == "gate_up":
        rs = _rows(arch.ffn_hidden_size, coords)
        return torch.cat([read(slot.hf_names[0], rs, full), read(slot.hf_names[1], rs, full)], 0)
    if kind == "expert_gate_up":
        return torch.cat(
            [read(slot.hf_names[0], full, full), read(slot.hf_names[1], full, full)], 0
        )
    if kind == "expert_stack_full":
        return torch.stack([read(n, full, full) for n in slot.hf_names])
    if kind in ("expert_fused_gate_up", "expert_fused_down"):
        f, h = int(arch.moe_ffn_hidden_size or 0), arch.hidden_size
        per_expert = (2 * f, h) if kind == "expert_fused_gate_up" else (h, f)
        rows = slice(slot.experts[0], slot.experts[-1] + 1)
        block = fused_experts_from_file(read(slot.hf_names[0], rows, full), per_expert)
        return block if slot.stacked else block[0]
    if kind == "expert_stack_gate_up":
        pairs = zip(slot.hf_names[0::2], slot.hf_names[1::2], strict=True)
        return torch.stack(
            [torch.cat([read(g, full, full), read(u, full, full)], 0) for g, u in pairs]
        )
    if kind == "qkv":
        d = arch.head_dim
        hpg = arch.num_attention_heads // arch.num_query_groups
        ng = arch.num_query_groups // coords.tp_size
        g0 = coords.tp_rank * ng
        q = read(slot.hf_names[0], slice(g0 * hpg * d, (g0 + ng) * hpg * d), full)
        k = read(slot.hf_names[1], slice(g0 * d, (g0 + ng) * d), full)
        v = read(slot.hf_names[2], slice(g0 * d, (g0 + ng) * d), full)
        tail = q.shape[1:]
        parts = [q.reshape(ng, hpg * d, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)]
        return torch.cat(parts, 1).reshape(-1, *tail)
    raise ValueError(f"unknown slot kind {kind!r}")


def unshard_to_hf(
    slot: Slot, shards: list[torch.Tensor], arch: DecoderModelConfig
) -> dict[str, torch.Tensor]:
    """HF tensors from every TP rank's megatron shard (in TP rank order)."""
    kind = slot.kind
    if kind in ("replicated", "expert_full"):
        return {slot.hf_names[0]: shards[0]}
    if kind == "expert_stack_full":
        return dict(zip(slot.hf_names, shards[0].unbind(0), strict=True))
    if kind == "expert_stack_gate_up":
        halves = [h for w in shards[0].unbind(0) for h in w.chunk(2, 0)]
        return dict(zip(slot.hf_names, halves, strict=True))
    if kind == "column":
        return {slot.hf_names[0]: torch.cat(shards, 0)}
    if kind == "row":
        return {slot.hf_names[0]: torch.cat(shards, 1)}
    if kind in ("gate_up", "expert_gate_up"):
        halves = [s.chunk(2, 0) for s in shards]
        return {
            slot.hf_names[0]: torch.cat([h[0] for h in halves], 0),
            slot.hf_names[1]: torch.cat([h[1] for h in halves], 0),
        }
    if kind == "qkv":
        d = arch.head_dim
        hpg = arch.num_attention_heads // arch.num_query_groups
        qs, ks, vs = [], [], []
        for s in shards:
            tail = s.shape[1:]
            g = s.reshape(-1, (hpg + 2) * d, *tail)
            q, k, v = torch.split(g, [hpg * d, d, d], dim=1)
            qs.append(q.reshape(-1, *tail))
            ks.append(k.reshape(-1, *tail))
            vs.append(v.reshape(-1, *tail))
        return {
            slot.hf_names[0]: torch.cat(qs, 0),
            slot.hf_names[1]: torch.cat(ks, 0),
            slot.hf_names[2]: torch.cat(vs, 0),
        }
    raise ValueError(f"unknown slot kind {kind!r}")
