"""DeepSeek-V3 Hugging Face tensors <-> megatron model chunks.

Each megatron tensor maps to the HF tensors it is made of and how tensor parallelism splits
it (core's ``hf_mapping.Slot``): ``replicated`` (norms, the router and its expert bias),
``rows`` (column-parallel linears: MLA's down and up projections, the embedding and head),
``cols`` (row-parallel linears: the attention output, the MLPs' down projections),
``gate_up`` (a SwiGLU's fused gate and up rows, each split) and the experts, which tensor
parallelism does not split (``expert_gate_up``, ``expert_full``, or a rank's experts
stacked in one tensor, ``expert_stack_*``, with grouped experts; local expert ``j`` of
expert-parallel rank ``r`` is HF expert ``r * local + j``).

Multi-token prediction depth ``i`` is stored as DeepSeek's checkpoints store it, as layer
``num_layers + i`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, its transformer
layer's tensors, and copies of the shared ``embed_tokens`` and ``shared_head.head``, which
loading skips); transformers' ``DeepseekV3ForCausalLM`` does not run these tensors.
Loading checks every expected tensor and its shape first and reports all problems at once;
saving gathers the tensor-parallel shards and lets one owner rank write each tensor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from longboat.core.megatron.hf_io import (
    HFCheckpointMismatch,
    check_hf_tensors,
    is_owner,
    rank_coords,
    tp_shards,
)
from longboat.core.megatron.hf_mapping import RankCoords, Slot
from longboat.llm.models.deepseek_v3.config import DeepseekV3Config

PREFIX = "model."
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_STACKED = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight$")

_ATTENTION = {
    "self_attention.linear_q_proj.weight": ("rows", "self_attn.q_proj.weight"),
    "self_attention.linear_q_down_proj.weight": ("rows", "self_attn.q_a_proj.weight"),
    "self_attention.q_layernorm.weight": ("replicated", "self_attn.q_a_layernorm.weight"),
    "self_attention.linear_q_up_proj.weight": ("rows", "self_attn.q_b_proj.weight"),
    "self_attention.linear_kv_down_proj.weight": ("rows", "self_attn.kv_a_proj_with_mqa.weight"),
    "self_attention.kv_layernorm.weight": ("replicated", "self_attn.kv_a_layernorm.weight"),
    "self_attention.linear_kv_up_proj.weight": ("rows", "self_attn.kv_b_proj.weight"),
    "self_attention.linear_proj.weight": ("cols", "self_attn.o_proj.weight"),
    # DeepSeek-V3.2's lightning indexer (every tensor parallel rank holds all of it)
    **{
        f"self_attention.core_attention.indexer.{ours}": ("replicated", f"self_attn.indexer.{hf}")
        for ours, hf in (
            ("linear_wq_b.weight", "wq_b.weight"),
            ("linear_wk.weight", "wk.weight"),
            ("k_norm.weight", "k_norm.weight"),
            ("k_norm.bias", "k_norm.bias"),
            ("linear_weights_proj.weight", "weights_proj.weight"),
        )
    },
    "input_layernorm.weight": ("replicated", "input_layernorm.weight"),
    "pre_mlp_layernorm.weight": ("replicated", "post_attention_layernorm.weight"),
    # Transformer Engine's layer spec (model.layer_backend=te) fuses these norms into the
    # linear that follows them
    "self_attention.linear_q_up_proj.layer_norm_weight": (
        "replicated",
        "self_attn.q_a_layernorm.weight",
    ),
    "self_attention.linear_kv_up_proj.layer_norm_weight": (
        "replicated",
        "self_attn.kv_a_layernorm.weight",
    ),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", "post_attention_layernorm.weight"),
    "mlp.linear_fc2.weight": ("cols", "mlp.down_proj.weight"),
    "mlp.router.weight": ("replicated", "mlp.gate.weight"),
    "mlp.router.expert_bias": ("replicated", "mlp.gate.e_score_correction_bias"),
    "mlp.shared_experts.linear_fc2.weight": ("cols", "mlp.shared_experts.down_proj.weight"),
}
_GATE_UP = {
    "mlp.linear_fc1.weight": "mlp.",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.",
}
_MTP_OWN = {
    "enorm.weight": ("replicated", "enorm.weight"),
    "hnorm.weight": ("replicated", "hnorm.weight"),
    "eh_proj.weight": ("rows", "eh_proj.weight"),
    "final_layernorm.weight": ("replicated", "shared_head.norm.weight"),
}


def _layer_slot(rest: str, hf: str, cfg: DeepseekV3Config, ep: RankCoords) -> Slot:
    if rest in _ATTENTION:
        kind, name = _ATTENTION[rest]
        return Slot(kind, (hf + name,))
    if rest in _GATE_UP:
        base = hf + _GATE_UP[rest]
        return Slot("gate_up", (base + "gate_proj.weight", base + "up_proj.weight"))
    local = cfg.num_experts // ep.ep_size
    stacked = _STACKED.match(rest)
    if stacked is not None:  # grouped experts: this rank's experts in one tensor
        experts = [f"{hf}mlp.experts.{ep.ep_rank * local + j}." for j in range(local)]
        if stacked.group(1) == "linear_fc1":
            names = [ex + p for ex in experts for p in ("gate_proj.weight", "up_proj.weight")]
            return Slot("expert_stack_gate_up", tuple(names))
        return Slot("expert_stack_full", tuple(ex + "down_proj.weight" for ex in experts))
    m = _EXPERT.match(rest)
    if m is None:
        raise KeyError(rest)
    expert = ep.ep_rank * local + int(m.group(1))
    ex = f"{hf}mlp.experts.{expert}."
    if m.group(2) == "linear_fc1":
        return Slot("expert_gate_up", (ex + "gate_proj.weight", ex + "up_proj.weight"))
    return Slot("expert_full", (ex + "down_proj.weight",))


def megatron_to_hf_slot(
    name: str, cfg: DeepseekV3Config, *, global_layer: int | None, ep: RankCoords
) -> Slot:
    """The ``Slot`` of megatron tensor ``name`` (``global_layer``: a decoder layer's index)."""
    if name == "embedding.word_embeddings.weight":
        return Slot("rows", (f"{PREFIX}embed_tokens.weight",))
    if name == "decoder.final_layernorm.weight":
        return Slot("replicated", (f"{PREFIX}norm.weight",))
    if name == "output_layer.weight":
        head = f"{PREFIX}embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
        return Slot("rows", (head,))
    m = _LAYER.match(name)
    if m is not None and global_layer is not None:
        return _layer_slot(m.group(2), f"{PREFIX}layers.{global_layer}.", cfg, ep)
    m = _MTP.match(name)
    if m is not None:
        hf = f"{PREFIX}layers.{cfg.num_layers + int(m.group(1))}."
        rest = m.group(2)
        if rest in _MTP_OWN:
            kind, hf_name = _MTP_OWN[rest]
            return Slot(kind, (hf + hf_name,))
        if rest.startswith("mtp_model_layer."):
            return _layer_slot(rest[len("mtp_model_layer.") :], hf, cfg, ep)
    raise KeyError(name)


def _layer_shapes(cfg: DeepseekV3Config, hf: str, moe: bool) -> dict[str, tuple[int, ...]]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q_width = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    a = hf + "self_attn."
    shapes: dict[str, tuple[int, ...]] = {
        hf + "input_layernorm.weight": (h,),
        hf + "post_attention_layernorm.weight": (h,),
        a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
        a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        a + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        a + "o_proj.weight": (h, heads * cfg.v_head_dim),
    }
    if cfg.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = (q_width, h)
    else:
        shapes[a + "q_a_proj.weight"] = (cfg.q_lora_rank, h)
        shapes[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes[a + "q_b_proj.weight"] = (q_width, cfg.q_lora_rank)
    if cfg.index_topk is not None:
        ix, d = a + "indexer.", cfg.index_head_dim
        shapes[ix + "wq_b.weight"] = (cfg.index_n_heads * d, int(cfg.q_lora_rank or h))
        shapes[ix + "wk.weight"] = (d, h)
        shapes[ix + "k_norm.weight"] = (d,)
        shapes[ix + "k_norm.bias"] = (d,)
        shapes[ix + "weights_proj.weight"] = (cfg.index_n_heads, h)

    def swiglu(base: str, width: int) -> None:
        shapes[base + "gate_proj.weight"] = (width, h)
        shapes[base + "up_proj.weight"] = (width, h)
        shapes[base + "down_proj.weight"] = (h, width)

    if not moe:
        swiglu(hf + "mlp.", cfg.ffn_hidden_size)
        return shapes
    f = int(cfg.moe_ffn_hidden_size or 0)
    shapes[hf + "mlp.gate.weight"] = (cfg.num_experts, h)
    shapes[hf + "mlp.gate.e_score_correction_bias"] = (cfg.num_experts,)
    for e in range(cfg.num_experts):
        swiglu(f"{hf}mlp.experts.{e}.", f)
    if cfg.num_shared_experts:
        swiglu(hf + "mlp.shared_experts.", cfg.num_shared_experts * f)
    return shapes


def expected_hf_shapes(cfg: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a DeepSeek-V3 HF checkpoint of ``cfg`` holds, with its shape."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes = {f"{PREFIX}embed_tokens.weight": (v, h), f"{PREFIX}norm.weight": (h,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(cfg.num_layers):
        shapes |= _layer_shapes(cfg, f"{PREFIX}layers.{i}.", i >= cfg.first_k_dense)
    for i in range(cfg.mtp_num_layers):
        hf = f"{PREFIX}layers.{cfg.num_layers + i}."
        shapes |= _layer_shapes(cfg, hf, True)
        shapes |= {hf + "enorm.weight": (h,), hf + "hnorm.weight": (h,),
                   hf + "eh_proj.weight": (h, 2 * h), hf + "shared_head.norm.weight": (h,),
                   hf + "embed_tokens.weight": (v, h), hf + "shared_head.head.weight": (v, h)}  # fmt: skip
    return shapes


def _mtp_copies(cfg: DeepseekV3Config) -> set[str]:
    """The MTP layers' copies of the embedding and head (written, never read)."""
    out = set()
    for i in range(cfg.mtp_num_layers):
        hf = f"{PREFIX}layers.{cfg.num_layers + i}."
        out |= {hf + "embed_tokens.weight", hf + "shared_head.head.weight"}
    return out


def _tensors(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A chunk's parameters and its routers' expert-bias buffers (HF stores the bias)."""
    yield from chunk.named_parameters()
    for name, buf in chunk.named_buffers():
        if name.endswith("router.expert_bias"):
            yield name, buf


def _named_slots(
    chunks: list[torch.nn.Module], cfg: DeepseekV3Config, coords: RankCoords
) -> Iterator[tuple[str, torch.Tensor, Slot]]:
    for chunk in chunks:
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        for name, tensor in _tensors(chunk):
            layer = None
            if name.startswith("decoder.layers."):
                layer = layers[int(name.split(".")[2])].layer_number - 1
            yield name, tensor, megatron_to_hf_slot(name, cfg, global_layer=layer, ep=coords)


def check_hf_checkpoint(hf_dir: str | Path, cfg: DeepseekV3Config) -> dict[str, Path]:
    """Raise ``HFCheckpointMismatch`` naming every missing, unexpected or mis-shaped tensor."""
    return check_hf_tensors(
        hf_dir,
        expected_hf_shapes(cfg),
        tie_embeddings=cfg.tie_embeddings,
        optional=_mtp_copies(cfg),
    )


def _share(n: int, coords: RankCoords) -> slice:
    per = n // coords.tp_size
    return slice(coords.tp_rank * per, (coords.tp_rank + 1) * per)


@torch.no_grad()
def load_hf_weights(
    chunks: list[torch.nn.Module],
    cfg: DeepseekV3Config,
    hf_dir: str | Path,
    *,
    progress: Any = None,
) -> int:
    """Copy an HF DeepSeek-V3 checkpoint into this rank's chunks (this rank's TP rows or
    columns, pipeline layers and experts only); returns the tensors loaded."""
    index = check_hf_checkpoint(hf_dir, cfg)
    coords = rank_coords()
    slots = list(_named_slots(chunks, cfg, coords))
    problems: list[str] = []
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def part(name: str, how: str) -> torch.Tensor:
            path = index[name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), "pt"))
            sl = handles[path].get_slice(name)
            shape = sl.get_shape()
            if how == "rows":
                return sl[_share(shape[0], coords)]
            if how == "cols":
                return sl[:, _share(shape[1], coords)]
            return sl[:]

        for done, (name, tensor, slot) in enumerate(slots, 1):
            kind, names = slot.kind, slot.hf_names
            if kind in ("rows", "cols"):
                value = part(names[0], kind)
            elif kind == "gate_up":
                value = torch.cat([part(names[0], "rows"), part(names[1], "rows")], 0)
            elif kind == "expert_gate_up":
                value = torch.cat([part(names[0], "all"), part(names[1], "all")], 0)
            elif kind == "expert_stack_gate_up":
                pairs = zip(names[0::2], names[1::2], strict=True)
                value = torch.stack(
                    [torch.cat([part(g, "all"), part(u, "all")], 0) for g, u in pairs]
                )
            elif kind == "expert_stack_full":
                value = torch.stack([part(n, "all") for n in names])
            else:
                value = part(names[0], "all")
            if tuple(value.shape) != tuple(tensor.shape):
                problems.append(
                    f"shape: megatron {name} is {list(tensor.shape)} but {list(names)} give "
                    f"{list(value.shape)} on this rank"
                )
                continue
            tensor.data.copy_(value.to(tensor.dtype))
            if progress is not None:
                progress(done, len(slots))
    if problems:
        raise HFCheckpointMismatch(str(hf_dir), problems)
    return len(slots)


def _unshard(slot: Slot, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    kind, names = slot.kind, slot.hf_names
    if kind in ("replicated", "expert_full"):
        return {names[0]: shards[0]}
    if kind == "rows":
        return {names[0]: torch.cat(shards, 0)}
    if kind == "cols":
        return {names[0]: torch.cat(shards, 1)}
    if kind == "expert_stack_full":
        return dict(zip(names, shards[0].unbind(0), strict=True))
    if kind == "expert_stack_gate_up":
        halves = [h for w in shards[0].unbind(0) for h in w.chunk(2, 0)]
        return dict(zip(names, halves, strict=True))
    halves = [s.chunk(2, 0) for s in shards]  # gate_up, expert_gate_up
    return {
        names[0]: torch.cat([h[0] for h in halves], 0),
        names[1]: torch.cat([h[1] for h in halves], 0),
    }


def gather_hf_state_dict(
    chunks: list[torch.nn.Module], cfg: DeepseekV3Config
) -> dict[str, torch.Tensor]:
    """This rank's share of the HF state dict (collective over the TP group)."""
    coords = rank_coords()
    out: dict[str, torch.Tensor] = {}
    for name, tensor, slot in _named_slots(chunks, cfg, coords):
        if name == "output_layer.weight" and cfg.tie_embeddings:
            continue
        local = tensor.detach().contiguous()
        split = slot.kind in ("rows", "cols", "gate_up")
        shards = tp_shards(local, coords) if split else [local]
        if is_owner(slot):
            out.update({k: v.clone() for k, v in _unshard(slot, shards).items()})
    for i in range(cfg.mtp_num_layers):  # the MTP layers' copies of the shared tensors
        hf = f"{PREFIX}layers.{cfg.num_layers + i}."
        head = f"{PREFIX}embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
        for src, dst in ((f"{PREFIX}embed_tokens.weight", "embed_tokens.weight"),
                         (head, "shared_head.head.weight")):  # fmt: skip
            if src in out:
                out[hf + dst] = out[src].clone()
    return out


def save_hf_weights(
    chunks: list[torch.nn.Module], cfg: DeepseekV3Config, out_dir: str | Path
) -> Path:
    """Write the model as HF safetensors (one file, or one shard per writing rank plus an
    index) into ``out_dir`` (collective)."""
    out_dir = Path(out_dir)
    state = gather_hf_state_dict(chunks, cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    has = [bool(state)] * world
    if world > 1:
        dist.all_gather_object(has, bool(state))
    writers = [r for r, h in enumerate(has) if h]
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("model*.safetensors*"):
            old.unlink()
    if world > 1:
        dist.barrier()
    n = len(writers)
    fname = "model.safetensors"
    if n > 1 and state:
        fname = f"model-{writers.index(rank) + 1:05d}-of-{n:05d}.safetensors"
    if state:
        save_file(state, str(out_dir / fname), metadata={"format": "pt"})
    local = ({k: fname for k in state}, sum(t.numel() * t.element_size() for t in state.values()))
    gathered: list[Any] = [local] * world
    if world > 1:
        dist.all_gather_object(gathered, local)
    if rank == 0:
        weight_map = {k: f for m, _ in gathered for k, f in m.items()}
        missing = sorted(set(expected_hf_shapes(cfg)) - set(weight_map))
        if missing:
            raise RuntimeError(f"export is missing tensors: {missing}")
        if n > 1:
            index = {"metadata": {"total_size": sum(b for _, b in gathered)},
                     "weight_map": dict(sorted(weight_map.items()))}  # fmt: skip
            tmp = out_dir / "model.safetensors.index.json.tmp"
            tmp.write_text(json.dumps(index, indent=2))
            os.replace(tmp, out_dir / "model.safetensors.index.json")
    if world > 1:
        dist.barrier()
    return out_dir
