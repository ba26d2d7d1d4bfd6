"""Find the repeated blocks of a policy: the unit of FSDP sharding and activation checkpointing."""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """Return the model's repeated blocks, outermost first, without nesting.

    A model may declare them with a ``parallel_blocks()`` method (preferred: it
    is explicit). Otherwise every element of every ``nn.ModuleList`` counts, except
    elements that sit inside an already-selected block, so a ViT layer list, an LM
    layer list and a DiT block list each contribute their layers once.
    """
    declared = getattr(model, "parallel_blocks", None)
    if callable(declared):
        return list(declared())
    blocks: list[nn.Module] = []
    taken: set[str] = set()
    for name, module in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if isinstance(module, nn.ModuleList):
            for idx, child in enumerate(module):
                blocks.append(child)
                taken.add(f"{name}.{idx}" if name else str(idx))
    return blocks
