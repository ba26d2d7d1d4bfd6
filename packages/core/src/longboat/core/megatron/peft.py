"""LoRA adapters as PEFT files, and PEFT adapters as the start of a LoRA run.

``save_peft`` writes ``adapter_config.json`` + ``adapter_model.safetensors`` that
``peft.PeftModel.from_pretrained(<the base HF model>, dir)`` loads with the same outputs as
longboat's adapted model. megatron fuses q / k / v (and gate / up) into one linear, whose
adapter has one ``A``: every HF projection of it gets that ``A`` and its rows of ``B``.

``load_peft`` starts the adapters (after ``apply_lora``, before the optimizer is built) from
such a directory. An adapter whose fused projections have different ``A`` matrices (one that
PEFT trained) is represented exactly by stacking them: the fused ``A`` gets rank ``k x r``
and each projection's ``B`` its own block of columns; its scale stays ``alpha / r``.

Both are collective under tensor parallelism (the adapter shards follow the base weight's
split; see ``longboat.core.megatron.lora``); rank 0 writes. ``prefix`` is where the decoder
sits in the transformers model the adapter is for (``model.`` for a causal LM,
``model.language_model.`` for a VLM's language model); a VLM's adapter also carries the
components that trained in full (``modules_to_save``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.hf_io import is_owner, rank_coords, tp_shards
from longboat.core.megatron.hf_mapping import (
    RankCoords,
    Slot,
    megatron_to_hf_slot,
    shard_from_hf,
    unshard_to_hf,
)
from longboat.core.megatron.lora import is_lora_adapted

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_ROW_KINDS = ("row",)  # A split over columns, B replicated; the other kinds split B's rows


SlotFn = Callable[..., Slot]
"""``slot_of(name, cfg, *, global_layer, ep, prefix) -> Slot``: a megatron tensor's HF names
and split, in ``hf_mapping``'s kinds (``megatron_to_hf_slot`` for Llama-style decoders)."""


def _adapted(
    chunks: list[torch.nn.Module],
    cfg: DecoderModelConfig,
    coords: RankCoords,
    prefix: str,
    slot_of: SlotFn | None = None,
) -> Iterator[tuple[torch.nn.Module, Slot]]:
    slot_of = slot_of or megatron_to_hf_slot
    for chunk in chunks:
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        for name, module in chunk.named_modules():
            if not is_lora_adapted(module):
                continue
            layer = None
            if name.startswith("decoder.layers."):
                layer = layers[int(name.split(".")[2])].layer_number - 1
            slot = slot_of(f"{name}.weight", cfg, global_layer=layer, ep=coords, prefix=prefix)
            yield module, slot


def _module_key(hf_weight: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn.q_proj``."""
    return hf_weight.removesuffix(".weight")


@torch.no_grad()
def save_peft(
    chunks: list[torch.nn.Module],
    cfg: DecoderModelConfig,
    out_dir: str | Path,
    *,
    rank: int,
    alpha: float,
    prefix: str = "model.",
    base_model: str | None = None,
    scoped_targets: bool = False,
    modules_to_save: dict[str, dict[str, torch.Tensor]] | None = None,
    slot_of: SlotFn | None = None,
    as_parameter: Callable[[str], str | None] | None = None,
) -> Path:
    """Write this model's LoRA adapters as a PEFT adapter directory (collective).

    ``prefix``: the decoder's place in the transformers model. ``scoped_targets``: name the
    adapted modules by a pattern under ``prefix`` (``target_modules`` a regex) rather than by
    their last names, for a model whose other parts have modules of the same names (a VLM's
    vision MLP). ``modules_to_save``: ``{module name: {HF tensor name: full weight}}`` of
    components that trained in full, written as PEFT's ``modules_to_save`` (from rank 0).
    ``slot_of``: the family's tensor mapping (``SlotFn``; None: the Llama-style one).
    ``as_parameter``: for an adapted HF module (``model.layers.0.mlp.gate_proj``), the
    ``target_parameters`` entry PEFT must adapt it by (e.g. ``mlp.gate_proj.weight``), or
    None for a ``target_modules`` name; for models whose module names PEFT re-targets (its
    transformers-5 mapping sends DeepSeek-V3's ``gate_proj`` / ``up_proj`` / ``down_proj`` to
    the fused routed experts). The tensors are named the same either way."""
    from safetensors.torch import save_file

    coords = rank_coords()
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    scales: dict[str, float] = {}
    for module, slot in _adapted(chunks, cfg, coords, prefix, slot_of):
        a, b = module.lora_A.detach().float(), module.lora_B.detach().float()
        if slot.kind in _ROW_KINDS:
            a_full, bs = torch.cat(tp_shards(a, coords), 1), {slot.hf_names[0]: b}
        else:  # experts are not split over tensor-parallel ranks
            shards = [b] if slot.kind.startswith("expert") else tp_shards(b, coords)
            a_full, bs = a, unshard_to_hf(slot, shards, cfg)
        if not is_owner(slot):
            continue
        for hf_name, b_i in bs.items():
            key = _module_key(hf_name)
            tensors[f"{_PEFT_PREFIX}{key}.lora_A.weight"] = (
                a_full.cpu().clone()
            )  # one per projection
            tensors[f"{_PEFT_PREFIX}{key}.lora_B.weight"] = b_i.contiguous().cpu()
            ranks[key], scales[key] = a_full.shape[0], module._lora_scale
    gathered: list[Any] = [(tensors, ranks, scales)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (tensors, ranks, scales))
    out = Path(out_dir)
    if not dist.is_initialized() or dist.get_rank() == 0:
        tensors, ranks, scales = {}, {}, {}
        for t, r, s in gathered:
            tensors.update(t)
            ranks.update(r)
            scales.update(s)
        for module_tensors in (modules_to_save or {}).values():
            for name, t in module_tensors.items():
                tensors[f"{_PEFT_PREFIX}{name}"] = t.detach().float().contiguous().cpu()
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        as_parameter = as_parameter or (lambda key: None)
        by_parameter = {key: as_parameter(key) for key in ranks}
        names = sorted({key.rsplit(".", 1)[-1] for key, p in by_parameter.items() if p is None})
        parameters = sorted({p for p in by_parameter.values() if p is not None})

        def pattern(key: str) -> str:
            return key if by_parameter[key] is None else f"{key}.weight"

        targets: list[str] | str = names
        if scoped_targets:  # PEFT full-matches a string against every module name
            targets = rf"{re.escape(prefix)}layers\.\d+\.\w+\.(?:{'|'.join(names)})"
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": rank,
            "lora_alpha": alpha,
            "target_modules": targets,
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": sorted(modules_to_save) if modules_to_save else None,
            **({"target_parameters": parameters} if parameters else {}),
            # Stacked adapters (see the module doc): their rank, and an alpha that keeps
            # their scale alpha / r.
            # (PEFT matches a parameter target's patterns against its weight's name.)
            "rank_pattern": {pattern(k): v for k, v in ranks.items() if v != rank},
            "alpha_pattern": {pattern(k): scales[k] * v for k, v in ranks.items() if v != rank},
        }
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return out


def read_peft(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(adapter_config.json, tensors by PEFT key)``; ``ValueError`` naming what is wrong."""
    from safetensors.torch import load_file

    root = Path(adapter_dir)
    config_file, weights = root / CONFIG_NAME, root / WEIGHTS_NAME
    for f in (config_file, weights):
        if not f.is_file():
            raise FileNotFoundError(
                f"{f} not found: lora.init_from must be a PEFT adapter directory "
                f"({CONFIG_NAME} + {WEIGHTS_NAME})"
            )
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"{config_file}: only plain LoRA adapters load (no DoRA, no other PEFT)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{config_file}: bias={config['bias']!r}; only bias='none' loads")
    return config, load_file(str(weights))


def _tp_rows(t: torch.Tensor, coords: RankCoords) -> torch.Tensor:
    """This tensor-parallel rank's equal share of ``t``'s rows."""
    per = t.shape[0] // coords.tp_size
    return t[coords.tp_rank * per : (coords.tp_rank + 1) * per]


@torch.no_grad()
def load_peft(
    chunks: list[torch.nn.Module],
    cfg: DecoderModelConfig,
    adapter_dir: str | Path,
    *,
    prefix: str = "model.",
    slot_of: SlotFn | None = None,
) -> int:
    """Set every adapter of ``chunks`` (``apply_lora`` first) from a PEFT adapter; returns how
    many were set. Each adapted linear's HF projections must be in the adapter. ``slot_of``:
    as in ``save_peft``."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    config, tensors = read_peft(adapter_dir)
    patterns = config.get("rank_pattern") or {}
    alphas = config.get("alpha_pattern") or {}
    arch, coords = cfg, rank_coords()
    count = 0
    for module, slot in _adapted(chunks, cfg, coords, prefix, slot_of):
        keys = [_module_key(n) for n in slot.hf_names]
        missing = [k for k in keys if f"{_PEFT_PREFIX}{k}.lora_A.weight" not in tensors]
        if missing:
            raise ValueError(
                f"{adapter_dir}: no adapter for {missing}; lora.targets must match the adapter's "
                f"target_modules {config.get('target_modules')}"
            )
        As = [tensors[f"{_PEFT_PREFIX}{k}.lora_A.weight"].float() for k in keys]
        Bs = [tensors[f"{_PEFT_PREFIX}{k}.lora_B.weight"].float() for k in keys]
        r = int(patterns.get(keys[0], config["r"]))
        scale = float(alphas.get(keys[0], config["lora_alpha"])) / r
        if len(As) > 1 and any(not torch.equal(As[0], a) for a in As[1:]):
            # Stack: A = [A_1; ...; A_k], B_i in its own column block (exact).
            width = sum(a.shape[0] for a in As)
            padded, at = [], 0
            for a, b in zip(As, Bs, strict=True):
                block = torch.zeros(b.shape[0], width)
                block[:, at : at + a.shape[0]] = b
                padded.append(block)
                at += a.shape[0]
            As, Bs = [torch.cat(As, 0)], padded
        row = slot.kind in _ROW_KINDS
        a_full = As[0]
        by_name = dict(zip(slot.hf_names, Bs, strict=True))

        def read(name: str, rows: Any, cols: Any, by_name: dict = by_name) -> torch.Tensor:
            return by_name[name][rows, slice(None) if cols == "tp" else cols]

        if row:
            b = by_name[slot.hf_names[0]]
        elif slot.kind in ("column", "gate_up"):  # this rank's rows of each B, by B's height
            b = torch.cat([_tp_rows(by_name[n], coords) for n in slot.hf_names], 0)
        else:
            b = shard_from_hf(slot, read, arch, coords)
        if row and coords.tp_size > 1:
            per = a_full.shape[1] // coords.tp_size
            a_full = a_full[:, coords.tp_rank * per : (coords.tp_rank + 1) * per]
        weight = module.weight
        module.lora_A = torch.nn.Parameter(a_full.to(weight.device, weight.dtype))
        module.lora_B = torch.nn.Parameter(b.to(weight.device, weight.dtype))
        sharded, dim = (module.lora_A, 1) if row else (module.lora_B, 0)
        set_tensor_model_parallel_attributes(sharded, True, dim, 1)
        for p in (module.lora_A, module.lora_B):
            if hasattr(weight, "allreduce"):
                p.allreduce = weight.allreduce
        module._lora_scale = scale
        count += 1
    return count


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "SlotFn", "load_peft", "read_peft", "save_peft"]
