"""Where ``transformers``' model of a VLM family keeps what a LoRA run trains: the module
names a PEFT adapter of the family uses (``PeftLayout``), as data a family module exposes as
``PEFT_LAYOUT``.

A LoRA run trains the decoder's adapters, plus the vision tower and the projector unless
``model.freeze`` names them. The adapters go under ``language``; a tower or projector that
trained goes into the adapter whole, as PEFT's ``modules_to_save`` (``modules_to_save``
picks the names and the family's HF tensors under each).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["PeftLayout"]


@dataclass(frozen=True)
class PeftLayout:
    """A family's module names in its ``transformers`` model (the in-memory names PEFT uses)."""

    language: str
    """Prefix of the decoder's layers (``model.language_model.``)."""
    vision: tuple[str, ...]
    """Modules saved whole when the tower trains (``model.visual``)."""
    projector: tuple[str, ...]
    """Modules saved whole when the projector trains. A name ending in ``.`` stands for
    each child of that module list (``model.visual.deepstack_merger_list.``): PEFT wraps a
    module it calls, and the model indexes the list rather than calling it."""
    cannot_save: Mapping[str, str] = field(default_factory=dict)
    """Component (``vision`` / ``projector``) -> why its trained weights cannot go into a PEFT
    adapter (a bare parameter, which ``modules_to_save`` cannot carry)."""

    def problem(self, trained: Sequence[str]) -> str | None:
        """Why the ``trained`` components (of ``vision`` / ``projector``) cannot be written
        into an adapter; None when they can."""
        for component in trained:
            if component in self.cannot_save:
                return f"trains the {component}, and {self.cannot_save[component]}"
        return None

    def modules_to_save(
        self, trained: Sequence[str], hf_state: Mapping[str, torch.Tensor]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """``{module name: {HF tensor name: tensor}}`` of the ``trained`` components, from
        ``hf_state`` (the family's tower and projector under their HF names); a module inside
        another one saved is left to the outer one."""
        names: list[str] = []
        for component in ("vision", "projector"):
            if component not in trained:
                continue
            for name in getattr(self, component):
                if not name.endswith("."):
                    names.append(name)
                    continue
                children = {k[len(name) :].split(".", 1)[0] for k in hf_state if k.startswith(name)}
                names += [f"{name}{c}" for c in sorted(children, key=_list_order)]
        outer = [n for n in names if not any(n.startswith(f"{o}.") for o in names if o != n)]
        modules = {}
        for name in dict.fromkeys(outer):
            tensors = {k: v for k, v in hf_state.items() if k.startswith(f"{name}.")}
            if tensors:
                modules[name] = tensors
        return modules


def _list_order(child: str) -> tuple[int, str]:
    return (int(child), "") if child.isdigit() else (1 << 30, child)
