"""longboat's ParallelConfig -> megatron-core process groups, validated up front."""

from __future__ import annotations

import pytest

from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import ParallelConfig
from longboat.core.distributed import run_multiprocess
from longboat.core.megatron.parallel_state import validate_layout


def test_layout_resolves_data_parallel() -> None:
    layout = validate_layout(ParallelConfig(tensor_parallel=2, pipeline_parallel=2), 8)
    assert (layout.data_parallel, layout.world_size) == (2, 8)


@pytest.mark.parametrize(
    ("parallel", "world", "message"),
    [
        (ParallelConfig(tensor_parallel=2), 3, "world size 3 is not divisible by"),
        (ParallelConfig(tensor_parallel=2, data_parallel=3), 4, "parallel.data_parallel=3"),
        (ParallelConfig(virtual_pipeline_parallel=2), 2, "parallel.virtual_pipeline_parallel=2"),
        (ParallelConfig(expert_parallel=3), 4, "parallel.expert_parallel=3"),
        (ParallelConfig(tensor_parallel=0), 4, "parallel.tensor_parallel=0"),
    ],
)
def test_bad_layouts_fail_before_any_group_is_built(
    parallel: ParallelConfig, world: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate_layout(parallel, world)


def _groups_worker(rank: int, world: int, parallel: ParallelConfig) -> dict[str, int]:
    from megatron.core import parallel_state as mps

    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(parallel, get_accelerator("cpu"))
    try:
        with pytest.raises(RuntimeError, match="already initialised"):
            parallel_state.initialize(parallel, get_accelerator("cpu"))
        return {
            "tp": mps.get_tensor_model_parallel_world_size(),
            "pp": mps.get_pipeline_model_parallel_world_size(),
            "dp": mps.get_data_parallel_world_size(),
            "ep": mps.get_expert_model_parallel_world_size(),
            "vpp": mps.get_virtual_pipeline_model_parallel_world_size() or 0,
            "tp_rank": mps.get_tensor_model_parallel_rank(),
        }
    finally:
        parallel_state.destroy()
        assert parallel_state.current_layout() is None


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("parallel", "want"),
    [
        (ParallelConfig(tensor_parallel=2), {"tp": 2, "pp": 1, "dp": 1, "ep": 1, "vpp": 0}),
        (
            ParallelConfig(pipeline_parallel=2, virtual_pipeline_parallel=2),
            {"tp": 1, "pp": 2, "dp": 1, "ep": 1, "vpp": 2},
        ),
        (ParallelConfig(expert_parallel=2), {"tp": 1, "pp": 1, "dp": 2, "ep": 2, "vpp": 0}),
    ],
    ids=["tp2", "pp2_vpp2", "dp2_ep2"],
)
def test_initialize_builds_megatron_groups(parallel: ParallelConfig, want: dict[str, int]) -> None:
    outs = run_multiprocess(_groups_worker, 2, parallel)
    for out in outs:
        assert {k: out[k] for k in want} == want
    if parallel.tensor_parallel == 2:
        assert sorted(o["tp_rank"] for o in outs) == [0, 1]


def _tp_lookup_worker(rank: int, world: int) -> dict[str, bool]:
    import warnings

    from megatron.core import parallel_state as mps
    from megatron.core import utils as mutils
    from megatron.core.tensor_parallel import layers, mappings

    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(ParallelConfig(tensor_parallel=2), get_accelerator("cpu"))
    try:
        group = mps.get_tensor_model_parallel_group()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet = [m.get_tensor_model_parallel_group_if_none(None) for m in (layers, mappings)]
            explicit = layers.get_tensor_model_parallel_group_if_none(group)
        out = {
            "same_group": all(g is group for g in quiet) and explicit is group,
            "silent": not caught,
        }
    finally:
        parallel_state.destroy()
    original = mutils.get_tensor_model_parallel_group_if_none
    out["restored"] = all(
        m.get_tensor_model_parallel_group_if_none is original for m in (layers, mappings)
    )
    return out


@pytest.mark.multiprocess
def test_tp_group_lookup_is_silent_and_undone_by_destroy() -> None:
    """megatron's per-linear TP-group lookup warns on every call (a torch.compile graph break);
    under initialize() it returns the same group silently, and destroy() restores megatron's."""
    for out in run_multiprocess(_tp_lookup_worker, 2):
        assert out == {"same_group": True, "silent": True, "restored": True}
