"""LoRA adapters on megatron's tensor-parallel linears, sharded like the base weight.

An adapter adds ``scale * B(A(x))`` to a linear's output (``scale = alpha / rank``).
Under tensor parallelism it follows the base layer's split so no full weight is ever built:

- column-parallel base ``W[out/tp, in]``: ``A[r, in]`` is replicated, ``B[out/tp, r]`` is
  split like ``W``'s rows. ``A``'s gradient sums over every rank's ``B`` shard, so the
  rank-``r`` activation passes megatron's *copy* region (identity forward, all-reduce
  backward): every rank then holds ``A``'s full gradient.
- row-parallel base ``W[out, in/tp]``: ``A[r, in/tp]`` is split like ``W``'s columns and
  ``B[out, r]`` is replicated; ``A``'s partial products are summed by the *reduce* region
  (all-reduce forward, identity backward), like the base output.

Adapters hang on the base module itself (``lora_A`` / ``lora_B`` parameters + a forward
hook), so the base weight keeps its name and the HF mapping still finds it.
``merge_lora`` folds ``scale * B @ A`` into each local weight shard and removes the
adapters, which is exact on every shard layout above; ``merged_lora`` does the same for the
length of a ``with`` block (an HF export of the merged weights mid-run) and then puts the
base weights and the very same adapter parameters back, so training and its optimizer carry
on as before. The llm and vlm stacks share this module.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["apply_lora", "is_lora_adapted", "lora_parameters", "merge_lora", "merged_lora"]

_HOOK = "_longboat_lora_hook"


def is_lora_adapted(module: torch.nn.Module) -> bool:
    """Whether ``apply_lora`` put an adapter on ``module`` (and it is not merged)."""
    return getattr(module, _HOOK, None) is not None


def _is_row_parallel(module: torch.nn.Module) -> bool:
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    return isinstance(module, RowParallelLinear)


def _is_parallel_linear(module: torch.nn.Module) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return isinstance(module, (ColumnParallelLinear, RowParallelLinear))


def _lora_hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    x = args[0]
    a, b = module.lora_A, module.lora_B
    h = torch.nn.functional.linear(x.to(a.dtype), a)
    group = module.tp_group
    if group.size() > 1:
        if module._lora_row:
            h = reduce_from_tensor_model_parallel_region(h, group=group)
        else:
            h = copy_to_tensor_model_parallel_region(h, group=group)
    delta = torch.nn.functional.linear(h, b) * module._lora_scale
    out, bias = output
    return out + delta.to(out.dtype), bias


def _targeted(name: str, wanted: set[str]) -> bool:
    """Whether module ``name`` is a LoRA target: its last name is in ``wanted``, or it ends with
    a dotted target (``mlp.linear_fc1``: the dense MLP's, not the experts' ``linear_fc1``)."""
    if name.rsplit(".", 1)[-1] in wanted:
        return True
    return any("." in t and (name == t or name.endswith("." + t)) for t in wanted)


def _init_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(name.encode()) * 31) % (2**63)
    )


def apply_lora(
    chunks: Iterable[torch.nn.Module],
    *,
    rank: int,
    alpha: float,
    targets: Iterable[str],
    seed: int = 0,
) -> int:
    """Freeze every parameter, then add adapters to the linears named in ``targets`` (a
    linear's last name, e.g. ``linear_fc1``, or a dotted tail of its module path, e.g.
    ``shared_experts.linear_fc1``).

    ``A`` starts Kaiming-uniform (fan-in: the layer's full input width) from a generator
    seeded by ``seed`` and the layer's name; a row-parallel shard takes its columns of that
    whole ``A``, so the adapters are the same at every tensor-parallel size and replicated
    ones are equal on every TP rank. ``B`` starts at zero, so the model's output is
    unchanged. Returns the number of adapted linears (0 raises: the targets matched nothing).
    """
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    wanted = set(targets)
    count = 0
    pp_rank = mps.get_pipeline_model_parallel_rank()
    for c, chunk in enumerate(chunks):
        for p in chunk.parameters():
            p.requires_grad_(False)
        for name, module in chunk.named_modules():
            if not _targeted(name, wanted) or not _is_parallel_linear(module):
                continue
            weight = module.weight
            out_local, in_local = weight.shape
            row = _is_row_parallel(module)
            # The whole A, then this rank's columns: the same adapters at every TP size.
            tp, tp_rank = (module.tp_group.size(), module.tp_group.rank()) if row else (1, 0)
            a = torch.empty(rank, in_local * tp, dtype=torch.float32)
            gen = _init_generator(seed, f"pp{pp_rank}.c{c}.{name}")
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            a = a[:, tp_rank * in_local : (tp_rank + 1) * in_local].to(weight.device)
            b = torch.zeros(out_local, rank, dtype=torch.float32, device=weight.device)
            module.lora_A = torch.nn.Parameter(a.to(weight.dtype))
            module.lora_B = torch.nn.Parameter(b.to(weight.dtype))
            sharded, dim = (module.lora_A, 1) if row else (module.lora_B, 0)
            set_tensor_model_parallel_attributes(sharded, True, dim, 1)
            for p in (module.lora_A, module.lora_B):
                if hasattr(weight, "allreduce"):  # expert linears: reduced over expert-DP
                    p.allreduce = weight.allreduce
            module._lora_row = row
            module._lora_scale = alpha / rank
            setattr(module, _HOOK, module.register_forward_hook(_lora_hook))
            count += 1
    if count == 0:
        raise ValueError(
            f"lora.targets={sorted(wanted)} matched no tensor-parallel linear of the model. "
            "Fix: name the model's linears (Llama-style: linear_qkv, linear_proj, linear_fc1, "
            "linear_fc2)."
        )
    return count


def lora_parameters(chunks: Iterable[torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    """Adapter parameters by their qualified name (prefixed ``chunk{i}.``)."""
    out: dict[str, torch.nn.Parameter] = {}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                out[f"chunk{i}.{name}"] = p
    return out


@torch.no_grad()
def merge_lora(chunks: Iterable[torch.nn.Module]) -> int:
    """Fold every adapter into its base weight shard and remove it; returns how many."""
    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            hook = getattr(module, _HOOK, None)
            if hook is None:
                continue
            delta = (module.lora_B.float() @ module.lora_A.float()) * module._lora_scale
            module.weight.add_(delta.to(module.weight.dtype))
            hook.remove()
            del module.lora_A, module.lora_B
            delattr(module, _HOOK)
            count += 1
    return count


@contextmanager
def merged_lora(chunks: Iterable[torch.nn.Module]) -> Iterator[int]:
    """Inside the block the adapters are folded into their base weights and gone from the
    modules (their state dicts hold the merged weights under the base names); afterwards
    each base weight is restored exactly and the same adapter parameters and hooks return.
    Yields the number of merged adapters."""
    chunks = list(chunks)
    saved = []
    with torch.no_grad():
        for chunk in chunks:
            for module in chunk.modules():
                if getattr(module, _HOOK, None) is None:
                    continue
                saved.append((module, module.weight.detach().clone(), module.lora_A, module.lora_B))
    count = merge_lora(chunks)
    try:
        yield count
    finally:
        with torch.no_grad():
            for module, weight, a, b in saved:
                module.weight.copy_(weight)
                module.lora_A, module.lora_B = a, b
                setattr(module, _HOOK, module.register_forward_hook(_lora_hook))
