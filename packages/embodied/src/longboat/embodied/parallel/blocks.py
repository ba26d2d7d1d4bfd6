"""Find the repeated blocks of a policy: the unit of FSDP sharding and activation checkpointing."""

from __future__ import annotations

from torch import nn

# Methods through which a model may run a block without calling the block itself:
# pi0.5's joint attention drives each LM / expert layer as ``project_qkv`` then
# ``finish``. FSDP hooks and activation checkpointing must see those calls.
KNOWN_BLOCK_METHODS = ("project_qkv", "finish")


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


def block_methods(block: nn.Module) -> list[str]:
    """Non-``forward`` methods the model calls to run ``block`` (see KNOWN_BLOCK_METHODS).

    A block class may declare them explicitly with a ``block_forward_methods`` tuple.
    """
    declared = getattr(block, "block_forward_methods", None)
    if declared is not None:
        return list(declared)
    return [m for m in KNOWN_BLOCK_METHODS if callable(getattr(block, m, None))]


def compile_blocks(model: nn.Module) -> int:
    """``torch.compile`` every block of ``model`` in place (``train.compile``): each block's
    ``forward`` call is compiled on first use. Run it after ``parallelize`` (the blocks are
    then the checkpoint wrappers / FSDP modules the model calls); returns how many."""
    blocks = find_blocks(model)
    for block in blocks:
        block.compile()
    return len(blocks)
