"""LoRA for the diffusion transformer (core's ``lora.*``), written as a diffusers LoRA.

The adapters are core's (``longboat.core.megatron.lora``: ``scale * B(A(x))`` on megatron's
tensor-parallel linears, base weights frozen, sharded like them); ``lora.targets`` names the
linears (Wan: the attention's ``linear_q`` / ``linear_k`` / ``linear_v`` / ``linear_proj``
and the FFN's ``linear_fc1`` / ``linear_fc2``, in self- and cross-attention).

The export holds the merged weights (a model or pipeline like any other run's), and the
adapters alone go to ``export.adapter_dir`` (null: ``<output_dir>/diffusers_lora``) as
``pytorch_lora_weights.safetensors`` with diffusers' names (``transformer.<module>.lora_A
.weight`` / ``lora_B.weight``), which a pipeline's ``load_lora_weights`` loads onto the base
transformer. Each adapter maps through the family's diffusers mapping of its base weight:
``A`` as it is, ``B``'s rows like the weight's rows (Wan's q / k head-channel order), and
the scale ``alpha / rank`` folded into ``B`` (diffusers then applies the adapter at scale 1).
Where several of our linears are column pieces of one diffusers weight (FLUX's single-block
``proj_out`` over ``cat(attention, mlp)``: our ``linear_proj`` and ``linear_fc2``), their
adapters become one of rank ``n * rank`` on it, exactly: ``A`` block-diagonal over the
pieces' columns, ``B`` the pieces' ``B`` side by side.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from longboat.core.config.errors import ProblemCollector

__all__ = ["ADAPTER_WEIGHTS", "adapter_dir", "lora_problems", "save_diffusers_lora"]

ADAPTER_WEIGHTS = "pytorch_lora_weights.safetensors"


def _tensor_map(family: Any, arch: Any) -> dict[str, Any]:
    impl = family.load()
    return importlib.import_module(f"{impl.__name__}.diffusers").tensor_map(arch)


def _targeted(mapping: dict[str, Any], targets: list[str]) -> dict[str, Any]:
    """The mapping's entries of the targeted linears' weights (by module name)."""
    out = {}
    for name, entry in mapping.items():
        module, _, kind = name.rpartition(".")
        if kind == "weight" and module.rpartition(".")[2] in targets:
            out[module] = entry
    return out


def lora_problems(p: ProblemCollector, cfg: Any, family: Any, arch: Any) -> None:
    """``lora.*`` / ``export.adapter_dir`` problems: a rank below 1, targets matching no
    linear of the model, an adapter export without LoRA."""
    lora = cfg.lora
    if cfg.export.adapter_dir is not None and not lora.enabled:
        p.add("export.adapter_dir", "the diffusion stack writes an adapter only with LoRA",
              value=cfg.export.adapter_dir, fix="set lora.enabled=true, or leave it null")  # fmt: skip
    if not lora.enabled:
        return
    if lora.rank < 1:
        p.add("lora.rank", "must be >= 1", value=lora.rank, fix="e.g. lora.rank=16")
    targeted = _targeted(_tensor_map(family, arch), list(lora.targets))
    if not targeted:
        p.add("lora.targets", "matches no linear of the model", value=list(lora.targets),
              fix="use linear_q, linear_k, linear_v, linear_proj, linear_fc1, linear_fc2")  # fmt: skip


def _diffusers_lora(
    full: dict[str, torch.Tensor], family: Any, arch: Any, cfg: Any
) -> dict[str, torch.Tensor]:
    """diffusers LoRA tensors of our full (TP 1) state dict's adapters (module doc)."""
    targeted = _targeted(_tensor_map(family, arch), list(cfg.lora.targets))
    scale = float(cfg.lora.alpha) / float(cfg.lora.rank)
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for module in targeted:  # map order: the order of a fused weight's column pieces
        if f"{module}.lora_A" not in full:
            continue
        theirs, _, to_theirs = targeted[module]
        a, b = full[f"{module}.lora_A"].float(), full[f"{module}.lora_B"].float() * scale
        target = f"transformer.{theirs.rpartition('.')[0]}"
        if to_theirs is None:
            pieces.setdefault(target, []).append((a, b))
            continue
        tensors[f"{target}.lora_A.weight"] = a
        tensors[f"{target}.lora_B.weight"] = to_theirs(b)
    for target, parts in pieces.items():
        tensors[f"{target}.lora_A.weight"] = torch.block_diag(*(a for a, _ in parts))
        tensors[f"{target}.lora_B.weight"] = torch.cat([b for _, b in parts], dim=1)
    return tensors


def adapter_dir(cfg: Any) -> Path:
    """Where the adapters go: ``export.adapter_dir``, else ``<output_dir>/diffusers_lora``."""
    return Path(cfg.export.adapter_dir or f"{cfg.output_dir}/diffusers_lora")


def save_diffusers_lora(model: torch.nn.Module, family: Any, arch: Any, cfg: Any) -> Path:
    """Write the model's adapters as a diffusers LoRA (module doc); collective over the
    tensor-parallel group, the global rank 0 writes. Returns the directory."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps
    from safetensors.torch import save_file

    from longboat.diffusion.models.diffusers_io import gather_state_dict, is_writer

    out = adapter_dir(cfg)
    writes = is_writer()
    if mps.get_data_parallel_rank(with_context_parallel=True) == 0:
        full = gather_state_dict(model, keep=writes)
        if writes:
            tensors = _diffusers_lora(full, family, arch, cfg)
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / (ADAPTER_WEIGHTS + ".tmp")
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
            os.replace(tmp, out / ADAPTER_WEIGHTS)
            info = {
                "rank": int(cfg.lora.rank),
                "alpha": float(cfg.lora.alpha),
                "scale_in_lora_B": float(cfg.lora.alpha) / float(cfg.lora.rank),
                "targets": list(cfg.lora.targets),
                "diffusers_class": family.diffusers_classes[0],
            }
            (out / "longboat_lora.json").write_text(json.dumps(info, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return out
