"""Optional LoRA through peft (``pip install longboat-embodied[lora]``)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def apply_lora(
    model: nn.Module,
    *,
    rank: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
) -> nn.Module:
    """Inject LoRA adapters into ``target_modules`` (Linear names) in place; only adapter
    weights train (fp32), everything else is frozen. Returns the model."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:  # pragma: no cover - depends on the extra
        raise ImportError(
            "LoRA needs peft: install longboat-embodied[lora] (pip install 'longboat-embodied[lora]')"
        ) from e
    model.requires_grad_(False)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules)
    )
    model = inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
            p.data = p.data.float()
    return model
