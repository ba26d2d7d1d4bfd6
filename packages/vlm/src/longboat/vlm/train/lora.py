"""LoRA on a VLM's language model (``lora.*``): core's adapters on the decoder only.

``apply_language_lora`` puts ``longboat.core.megatron.lora`` adapters on the decoder's
tensor-parallel linears (``lora.targets``) and freezes the decoder's base weights; the
vision tower and the projector train or not as ``model.freeze`` says. It runs before
megatron's DDP is built, so only the adapters and the unfrozen components get gradient
buffers and optimizer state. The adapters are parameters of the model, so checkpoints and
resume carry them like any other weight. ``merged_language(model)`` is the ``with`` block
an HF export runs in: the adapters folded into the decoder's weights, put back afterwards.

``save_language_adapter`` writes the adapters on their own as a PEFT adapter directory
(``longboat.core.megatron.peft``) for ``transformers``' model of the family: the decoder's
adapters under the decoder prefix of the family's ``PEFT_LAYOUT``
(``longboat.vlm.models.peft_layout``), and the vision tower or the projector where they
trained too (not in ``model.freeze``) as PEFT's ``modules_to_save``, so the adapter on the
source checkpoint is the trained model. A family whose trained part PEFT cannot carry (a bare
parameter) says why (``adapter_export_problem``), before training.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError

__all__ = [
    "adapter_export_problem",
    "apply_language_lora",
    "merged_language",
    "save_language_adapter",
    "validate_adapter_export",
]


def apply_language_lora(model: Any, lora: Any, *, frozen: Sequence[str] = (), seed: int = 0) -> int:
    """Adapters on ``model.language`` when ``lora`` (a core ``LoRAConfig``) is enabled;
    returns how many linears got one (0 without LoRA)."""
    if lora is None or not lora.enabled:
        return 0
    from longboat.core.megatron.lora import apply_lora

    if lora.rank < 1:
        raise ConfigError("must be >= 1", key="lora.rank", value=lora.rank)
    if "language" in frozen:
        raise ConfigError(
            "freezes the language model that lora.enabled=true trains adapters on",
            key="model.freeze",
            value=list(frozen),
            fix="remove language from model.freeze (LoRA freezes the decoder's base weights)",
        )
    targets = list(lora.targets)
    try:
        return apply_lora(
            [model.language], rank=lora.rank, alpha=lora.alpha, targets=targets, seed=seed
        )
    except ValueError:
        raise ConfigError(
            "matched no tensor-parallel linear of the language model",
            key="lora.targets",
            value=targets,
            fix="use any of linear_qkv, linear_proj, linear_fc1, linear_fc2",
        ) from None


def merged_language(model: Any) -> AbstractContextManager[int]:
    """Inside the block the decoder's adapters are merged into its weights and absent from
    the module (what ``save_hf`` writes); afterwards the model is exactly as before."""
    from longboat.core.megatron.lora import merged_lora

    return merged_lora([model.language])


def validate_adapter_export(cfg: Any, world_size: int | None, problems: Any) -> None:
    """``export.adapter_dir`` only with ``lora.enabled=true`` (a ``Stack.validators`` entry)."""
    export = cfg.get("export") or {}
    adapter = export.get("adapter_dir")
    if adapter is not None and not (cfg.get("lora") or {}).get("enabled"):
        problems.add(
            "export.adapter_dir",
            "is where the vlm stack writes LoRA adapters, but lora.enabled=false",
            value=adapter,
            fix="set lora.enabled=true, or leave export.adapter_dir null",
        )


def adapter_export_problem(
    family_module: Any, frozen: Sequence[str] = ()
) -> tuple[str, str] | None:
    """``(why, fix)`` where the family's LoRA run with ``frozen`` components cannot be written
    as a PEFT adapter (``fix`` empty or a clause ending in ``", or "``); None where it can."""
    layout = getattr(family_module, "PEFT_LAYOUT", None)
    if layout is None:
        return "has no PEFT adapter layout (its adapters go only into the merged export)", ""
    trained = _trained(frozen)
    why = layout.problem(trained)
    if why is None:
        return None
    unsaved = [c for c in trained if c in layout.cannot_save]
    return why, f"add {' and '.join(unsaved)} to model.freeze, or "


def _trained(frozen: Sequence[str]) -> list[str]:
    return [c for c in ("vision", "projector") if c not in frozen]


def save_language_adapter(
    model: Any,
    model_cfg: Any,
    family_module: Any,
    lora: Any,
    out_dir: str | Path,
    *,
    frozen: Sequence[str] = (),
    base_model: str | None = None,
) -> Path:
    """Write the decoder's adapters (and the tower or projector where they trained) as a PEFT
    adapter directory for ``base_model`` (collective, like the HF export), named after the
    family's ``PEFT_LAYOUT``."""
    from longboat.core.megatron.peft import save_peft

    layout = family_module.PEFT_LAYOUT
    trained = _trained(frozen)
    modules = {}
    if trained:
        visual = family_module.visual_hf_state(model, model_cfg)  # collective
        modules = layout.modules_to_save(trained, visual)
    return save_peft(
        [model.language],
        model_cfg.language,
        out_dir,
        rank=lora.rank,
        alpha=lora.alpha,
        prefix=layout.language,
        base_model=base_model,
        scoped_targets=True,
        modules_to_save=modules or None,
    )
