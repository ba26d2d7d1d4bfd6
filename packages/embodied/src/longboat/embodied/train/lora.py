"""LoRA for embodied policies (core's ``lora.*`` keys), written out as a PEFT adapter.

``apply_lora`` replaces every targeted ``nn.Linear`` of the policy by a ``LoRALinear``: the
linear as it was (``base_layer``, frozen) plus ``scale * B(A(dropout(x)))`` with
``scale = alpha / rank``, ``A`` initialised like a linear's weight and ``B`` at zero (the
policy starts where its base weights are). Every other parameter is frozen too, so only
the adapters train. ``lora.targets`` names linears as PEFT's ``target_modules`` does: a
name matches a linear whose module path is that name or ends with ``.<name>``; an empty
list means the policy's defaults (its ``PolicyFamily.lora_targets``, usually its language
model's attention and MLP linears and its action head's linears; every linear where the
policy names none).

The export holds the merged weights (``merge_lora_state`` on the gathered full state dict:
each adapted linear is put back with ``W + scale * B @ A``, so the exported keys and every
export format are those of a run without LoRA; the same under DDP, ZeRO-1, FSDP2 and HSDP,
whose shards the gathering joins), and ``save_peft_adapter`` writes the adapters alone as a PEFT adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``, keys
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``) that
``peft.PeftModel.from_pretrained(policy, folder)`` loads onto the base policy.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from longboat.embodied.models.registry import find_policy

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "LoRALinear",
    "adapter_dir",
    "apply_lora",
    "apply_run_lora",
    "describe_lora",
    "lora_linears",
    "lora_scales",
    "lora_targets",
    "match_targets",
    "merge_lora_state",
    "peft_adapter_state",
    "save_peft_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoRALinear(nn.Module):
    """A frozen linear plus a low-rank update (module doc); ``weight`` / ``bias`` are the
    base linear's, so code that reads a linear's dtype or device reads the same."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base_layer = base
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        a = self.lora_A.weight
        low = self.lora_B(self.lora_A(self.lora_dropout(x).to(a.dtype)))
        return out + (low * self.scale).to(out.dtype)

    def delta(self) -> torch.Tensor:
        """``scale * B @ A`` in fp32 (the update merged into the base weight)."""
        return self.lora_B.weight.float() @ self.lora_A.weight.float() * self.scale


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def lora_targets(model_name: str, targets: Sequence[str]) -> list[str]:
    """The names ``lora.targets`` means: as given, or when empty the policy's defaults
    (``PolicyFamily.lora_targets`` of ``model_name``; none: every linear)."""
    if targets:
        return list(targets)
    family = find_policy(model_name)
    return list(family.lora_targets) if family is not None else []


def match_targets(model: nn.Module, targets: Sequence[str]) -> dict[str, list[str]]:
    """Each target -> the module paths of the ``nn.Linear``s it matches (PEFT's rule: the
    path is the name or ends with ``.<name>``; no targets: every linear under ``""``)."""
    linears = [n for n, m in _unwrap(model).named_modules() if isinstance(m, nn.Linear) and n]
    if not targets:
        return {"": linears}
    return {t: [n for n in linears if n == t or n.endswith("." + t)] for t in targets}


def apply_lora(
    model: nn.Module, targets: Sequence[str], *, rank: int, alpha: float, dropout: float
) -> list[str]:
    """Freeze every parameter of ``model`` and wrap the linears ``targets`` match
    (``match_targets``) in ``LoRALinear`` adapters (fp32, trainable). Returns the adapted
    module paths; raises ``ValueError`` naming a target that matches no linear."""
    matched = match_targets(model, targets)
    empty = [t for t, names in matched.items() if not names]
    if empty:
        raise ValueError(f"lora.targets {empty} match no nn.Linear of the policy")
    names = sorted({n for found in matched.values() for n in found})
    model.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, dropout))
    return names


def lora_linears(model: nn.Module) -> dict[str, LoRALinear]:
    """The policy's adapted linears by module path (a DDP / compile wrapper unwrapped)."""
    return {
        n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): m
        for n, m in _unwrap(model).named_modules()
        if isinstance(m, LoRALinear)
    }


def merge_lora_state(
    state: dict[str, torch.Tensor], scales: dict[str, float]
) -> dict[str, torch.Tensor]:
    """A full state dict of the adapted policy -> the policy's own: each adapted linear
    ``<name>`` (``scales``: its ``alpha / rank``) becomes ``<name>.weight = W + scale * B @ A``
    (computed in fp32, stored in W's dtype) and ``<name>.bias``; the adapters' keys go. Every
    other key is kept as it is."""
    adapters = {f"{n}.lora_{ab}.weight" for n in scales for ab in "AB"}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in adapters:
            continue
        name, sep, rest = key.partition(".base_layer.")
        if not (sep and name in scales):
            out[key] = value
            continue
        if rest == "weight":
            a = state[f"{name}.lora_A.weight"].float()
            b = state[f"{name}.lora_B.weight"].float().to(a.device)
            merged = value.float() + (b @ a * scales[name]).to(value.device)
            value = merged.to(value.dtype)
        out[f"{name}.{rest}"] = value
    return out


def lora_scales(model: nn.Module) -> dict[str, float]:
    """Each adapted linear's ``alpha / rank`` by module path."""
    return {name: m.scale for name, m in lora_linears(model).items()}


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor: an FSDP2 shard gathered (a collective), else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def peft_adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters with PEFT's names (``base_model.model.<module>.lora_A.weight`` /
    ``lora_B.weight``), fp32 on the CPU; ``scale`` stays out (PEFT applies
    ``lora_alpha / r``). Under FSDP2 / HSDP every rank calls it (the shards are gathered)."""
    out = {}
    for name, m in lora_linears(model).items():
        for ab in ("lora_A", "lora_B"):
            weight = _full(getattr(m, ab).weight.detach())
            out[f"base_model.model.{name}.{ab}.weight"] = weight.float().cpu()
    return out


def adapter_dir(cfg: Any) -> Path:
    """Where the adapter goes: ``export.adapter_dir``, else ``<output_dir>/adapter``."""
    return Path(cfg.export.adapter_dir or Path(cfg.output_dir) / "adapter")


def save_peft_adapter(
    model: nn.Module,
    out: str | Path,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    base_model: str | None = None,
) -> Path:
    """Write the adapters as a PEFT LoRA adapter folder (module doc); every rank calls it
    (FSDP2 / HSDP shards are gathered), rank 0 writes. ``target_modules`` is a regex of
    exactly the adapted paths, so PEFT adapts the same linears."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    out = Path(out)
    tensors = peft_adapter_state(model)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(lora_linears(model))
    tmp = out / (ADAPTER_WEIGHTS + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), {"format": "pt"})
    os.replace(tmp, out / ADAPTER_WEIGHTS)
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "target_modules": "^(" + "|".join(re.escape(n) for n in names) + ")$",
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def apply_run_lora(model: nn.Module, cfg: Any) -> dict[str, int]:
    """``lora.*`` of a run on its freshly built policy (before it moves to the device):
    the adapters as ``apply_lora`` adds them; a target matching no linear is a
    ``ConfigError`` naming ``lora.targets``. Returns the trainable / frozen counts."""
    from longboat.core.config.errors import ProblemCollector

    lora = cfg.lora
    targets = lora_targets(cfg.model.name, lora.targets)
    empty = [t for t, names in match_targets(model, targets).items() if not names]
    if empty:
        p = ProblemCollector()
        p.add("lora.targets", f"{empty} match no nn.Linear of the {cfg.model.name} policy",
              value=list(lora.targets),
              fix="name linears by module path or its last parts, e.g. q_proj, v_proj; "
              "[] takes the policy's defaults")  # fmt: skip
        p.raise_if_any()
    apply_lora(model, targets, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout)
    counts = {"trainable": 0, "frozen": 0}
    for p_ in model.parameters():
        counts["trainable" if p_.requires_grad else "frozen"] += p_.numel()
    return counts


def describe_lora(model: nn.Module, cfg: Any) -> str:
    """The run's LoRA line."""
    lo = cfg.lora
    n = len(lora_linears(model))
    return (
        f"LoRA: rank {lo.rank}, alpha {lo.alpha:g}, dropout {lo.dropout:g} on {n} linears "
        f"({', '.join(lora_targets(cfg.model.name, lo.targets)) or 'every linear'}); the export "
        f"holds the merged weights, the PEFT adapter goes to {adapter_dir(cfg)}."
    )
