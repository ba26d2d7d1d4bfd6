"""Find the repeated blocks of a model: the unit of FSDP sharding, activation recompute and
per-block compile."""

from __future__ import annotations

from collections.abc import Sequence

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


def block_methods(block: nn.Module, known: Sequence[str] = ()) -> list[str]:
    """Non-``forward`` methods the model calls to run ``block`` (a model may drive a block
    through other methods than ``forward``, e.g. a joint attention that runs each layer as
    ``project_qkv`` then ``finish``; FSDP hooks must see those calls).

    A block class declares them with a ``block_forward_methods`` tuple; otherwise those of
    ``known`` (the stack's list of such method names) the block has.
    """
    declared = getattr(block, "block_forward_methods", None)
    if declared is not None:
        return list(declared)
    return [m for m in known if callable(getattr(block, m, None))]


def compile_blocks(model: nn.Module) -> int:
    """``torch.compile`` every block of ``model`` in place (``train.compile``): each block's
    ``forward`` call is compiled on first use. Run it after ``parallelize`` (the blocks are
    then the checkpoint wrappers / FSDP modules the model calls); returns how many."""
    blocks = find_blocks(model)
    for block in blocks:
        block.compile()
    return len(blocks)
