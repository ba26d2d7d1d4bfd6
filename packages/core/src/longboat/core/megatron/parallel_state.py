"""megatron-core parallel state from longboat's ``ParallelConfig``.

``initialize`` validates the layout against the world size before touching any
process group, installs the accelerator's megatron adapter (CPU: the call-site
patches of ``adapters.CPUMegatronAdapter``), builds megatron's TP / PP (with
virtual stages) / CP / EP / DP groups, seeds megatron's RNG tracker and answers
megatron's per-call TP-group lookup without its deprecation warning
(``quiet_tp_group_lookup``). ``destroy`` undoes all of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import ParallelConfig
from longboat.core.megatron._patching import PatchSet
from longboat.core.megatron.adapters import MegatronAdapter, check_megatron_version
from longboat.core.megatron.multi_tensor import multi_tensor_fallbacks


@dataclass(frozen=True)
class MegatronParallel:
    """The resolved layout ``initialize`` built (dp inferred)."""

    tensor_parallel: int
    pipeline_parallel: int
    virtual_pipeline_parallel: int | None
    context_parallel: int
    expert_parallel: int
    data_parallel: int
    world_size: int


_STATE: dict[str, Any] = {"adapter": None, "layout": None, "patches": None}

# Modules that call ``get_tensor_model_parallel_group_if_none`` per forward / backward.
_TP_LOOKUP_MODULES = (
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
)


def quiet_tp_group_lookup() -> PatchSet:
    """Answer megatron's per-call TP-group lookup with the group, without a warning.

    megatron 0.19's ``RowParallelLinear`` (and the TP mappings) pass ``tp_group=None`` on
    every call to a helper that then issues a ``DeprecationWarning`` before returning the
    default TP group. The warning machinery costs host time in every linear of every layer
    in eager mode, and ``warnings.warn`` is a torch.compile graph break (four per decoder
    layer). The replacement returns the same group silently; explicit groups and the expert
    lookup go to megatron's helper. Undone by ``destroy()``.
    """
    import importlib

    from megatron.core import parallel_state as mps
    from megatron.core import utils as mutils

    original = mutils.get_tensor_model_parallel_group_if_none
    group = mps.get_tensor_model_parallel_group()

    def lookup(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
        if tp_group is not None or is_expert:
            return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)
        return group

    patches = PatchSet()
    for name in _TP_LOOKUP_MODULES:
        patches.set_attr(
            importlib.import_module(name), "get_tensor_model_parallel_group_if_none", lookup
        )
    return patches


def validate_layout(parallel: ParallelConfig, world_size: int) -> MegatronParallel:
    """Check ``parallel`` against ``world_size``; return the layout with dp resolved.

    Collects every problem and raises one ``ConfigError`` naming each key.
    """
    problems: list[str] = []
    sizes = {
        "parallel.tensor_parallel": parallel.tensor_parallel,
        "parallel.pipeline_parallel": parallel.pipeline_parallel,
        "parallel.context_parallel": parallel.context_parallel,
        "parallel.expert_parallel": parallel.expert_parallel,
    }
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            problems.append(f"{key}={value!r}: must be a positive integer. Fix: set {key}>=1.")
    vpp = parallel.virtual_pipeline_parallel
    if vpp is not None and (vpp < 1 or (vpp > 1 and parallel.pipeline_parallel < 2)):
        problems.append(
            f"parallel.virtual_pipeline_parallel={vpp!r}: interleaving needs "
            "pipeline_parallel>=2 and a positive number of virtual stages. "
            "Fix: set it to null or raise parallel.pipeline_parallel."
        )
    if problems:
        raise ConfigError("; ".join(problems))
    mp = parallel.tensor_parallel * parallel.pipeline_parallel * parallel.context_parallel
    dp = parallel.data_parallel
    if world_size % mp != 0:
        raise ConfigError(
            f"parallel: world size {world_size} is not divisible by tensor_parallel * "
            f"pipeline_parallel * context_parallel = {mp}. Fix: launch a multiple of {mp} "
            "processes or shrink the model-parallel sizes."
        )
    if dp == -1:
        dp = world_size // mp
    elif dp * mp != world_size:
        raise ConfigError(
            f"parallel.data_parallel={dp}: tp*pp*cp*dp = {dp * mp} but the world size is "
            f"{world_size}. Fix: set parallel.data_parallel=-1 (infer) or {world_size // mp}."
        )
    # megatron lays experts over the dp*cp ranks of one pipeline stage (expert tp = 1 here).
    ep = parallel.expert_parallel
    if (dp * parallel.context_parallel * parallel.tensor_parallel) % ep != 0:
        raise ConfigError(
            f"parallel.expert_parallel={ep}: must divide tp*cp*dp = "
            f"{dp * parallel.context_parallel * parallel.tensor_parallel} (ranks per pipeline "
            "stage). Fix: choose an expert_parallel that divides it."
        )
    return MegatronParallel(
        tensor_parallel=parallel.tensor_parallel,
        pipeline_parallel=parallel.pipeline_parallel,
        virtual_pipeline_parallel=vpp if vpp and vpp > 1 else None,
        context_parallel=parallel.context_parallel,
        expert_parallel=ep,
        data_parallel=dp,
        world_size=world_size,
    )


def initialize(
    parallel: ParallelConfig,
    accelerator: Any | None = None,
    *,
    seed: int = 1234,
) -> MegatronParallel:
    """Build megatron-core's process groups for ``parallel`` on ``accelerator``.

    torch.distributed must already be initialised (``longboat.core.distributed``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "longboat.core.megatron.parallel_state.initialize needs torch.distributed; "
            "call longboat.core.distributed.init_distributed() first."
        )
    layout = validate_layout(parallel, dist.get_world_size())
    check_megatron_version()
    if _STATE["layout"] is not None:
        raise RuntimeError("megatron parallel state is already initialised; call destroy() first.")

    adapter = _resolve_adapter(accelerator)
    if adapter is not None:
        adapter.install()
    _STATE["adapter"] = adapter

    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    try:
        mps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor_parallel,
            pipeline_model_parallel_size=layout.pipeline_parallel,
            virtual_pipeline_model_parallel_size=layout.virtual_pipeline_parallel,
            context_parallel_size=layout.context_parallel,
            expert_model_parallel_size=layout.expert_parallel,
            expert_tensor_parallel_size=1,
            create_gloo_process_groups=True,
        )
        model_parallel_cuda_manual_seed(seed)
        _STATE["patches"] = [quiet_tp_group_lookup()]
        _STATE["patches"].append(multi_tensor_fallbacks())
    except BaseException:
        destroy()
        raise
    _STATE["layout"] = layout
    return layout


@contextmanager
def single_process() -> Iterator[None]:
    """Megatron's parallel state for one CPU process (a world-size-1 gloo group when none
    exists), torn down after: offline conversion and export of a native checkpoint."""
    from longboat.core.device import get_accelerator
    from longboat.core.distributed.init import single_process_group

    cpu = get_accelerator("cpu")
    owns_group = single_process_group(cpu)
    initialize(ParallelConfig(), cpu)
    try:
        yield
    finally:
        destroy()
        if owns_group:
            dist.destroy_process_group()


def destroy() -> None:
    """Destroy megatron's process groups and uninstall the accelerator adapter."""
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel import random as mrandom

    for patches in reversed(_STATE["patches"] or []):
        patches.undo()
    _STATE["patches"] = None
    mps.destroy_model_parallel()
    mrandom.initialize_rng_tracker(force_reset=True)
    adapter = _STATE["adapter"]
    if adapter is not None:
        adapter.uninstall()
    _STATE["adapter"] = None
    _STATE["layout"] = None


def current_layout() -> MegatronParallel | None:
    """The layout of the live megatron parallel state, or None."""
    return _STATE["layout"]


def _resolve_adapter(accelerator: Any | None) -> MegatronAdapter | None:
    if accelerator is None:
        from longboat.core.device import get_accelerator

        accelerator = get_accelerator()
    adapter = accelerator.megatron_adapter()
    if adapter is not None and not isinstance(adapter, MegatronAdapter):
        raise TypeError(
            f"accelerator {getattr(accelerator, 'name', accelerator)!r} returned "
            f"{type(adapter).__name__} from megatron_adapter(); it must implement "
            "longboat.core.megatron.adapters.MegatronAdapter (install/uninstall)."
        )
    return adapter
