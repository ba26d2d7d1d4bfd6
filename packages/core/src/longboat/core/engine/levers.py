"""Which levers of the torch step engine a run takes: ``train.master_weights`` and
``train.cuda_graph`` resolved (null: on where they apply), with one line per lever left off,
and the layout the CUDA-graph step needs. Import-free (config validation runs it before
torch is imported); ``train`` is a stack's train config node or dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from longboat.core.config.errors import ProblemCollector
from longboat.core.engine import MASTER_WEIGHT_STRATEGIES


def check_cuda_graph_layout(
    train: Any, dp_size: int | None, problems: ProblemCollector, *, stack: str
) -> None:
    """``train.cuda_graph`` needs master weights and one micro-batch a step per rank; ``train``
    is the composed node or the typed train config, ``dp_size`` the data-parallel size (the
    world size for the torch engine; None: unknown, that part is checked when the run is
    built), ``stack`` the name of the stack whose run it is (the message names it)."""

    def get(key: str) -> Any:
        return train.get(key) if hasattr(train, "get") else getattr(train, key, None)

    if not get("cuda_graph"):
        return
    if not get("master_weights"):
        problems.add(
            "train.cuda_graph",
            f"the {stack} stack captures the step only with the capturable optimizer step of "
            "train.master_weights",
            value=True,
            fix="set train.master_weights=true (and train.precision=bf16) or "
            "train.cuda_graph=false",
        )
    gbs, mbs = get("global_batch_size"), get("micro_batch_size")
    if gbs is not None and dp_size is not None and gbs != mbs * dp_size:
        problems.add(
            "train.cuda_graph",
            f"captures one micro-batch per step, but global_batch_size={gbs} is "
            f"{gbs // max(1, mbs * dp_size)} accumulated micro-batches",
            value=True,
            fix=f"set train.global_batch_size={mbs * dp_size} (or null) or train.cuda_graph=false",
        )


@dataclass(frozen=True)
class FastPath:
    """What ``train.master_weights`` and ``train.cuda_graph`` resolve to for one run
    (``resolve_fast_path``), with a one-line notice per lever left off where it could help."""

    master_weights: bool
    cuda_graph: bool
    graph_auto: bool = False
    """``train.cuda_graph`` was null: a host sync found before the capture falls back to eager
    steps with a warning instead of failing the run."""
    notices: tuple[str, ...] = ()


def resolve_fast_path(
    train: Any, *, strategy: str, optim_name: str, device_type: str, accum: int, dp_size: int = 1
) -> FastPath:
    """Resolve null ``train.master_weights`` / ``train.cuda_graph`` (on where they apply: master
    weights for bf16 + a strategy in ``MASTER_WEIGHT_STRATEGIES`` + AdamW, the graph also for
    one micro-batch a step on CUDA, one rank, no recompute or compile); explicit values stay as given (validation checked them)."""
    notices: list[str] = []
    master = train.master_weights
    if master is None:
        why = None
        if strategy not in MASTER_WEIGHT_STRATEGIES:
            why = f"parallel.strategy={strategy} shards or wraps the params"
        elif optim_name != "adamw":
            why = f"optim.name={optim_name}"
        master = train.precision == "bf16" and why is None
        if train.precision == "bf16" and why:
            notices.append(f"train.master_weights: off ({why}); fp32 params under bf16 autocast.")
    graph = train.cuda_graph
    auto = graph is None
    if graph is None:
        why = None
        if not master:
            pass  # a bf16 run without master weights said so above
        elif accum != 1:
            why = f"gradient accumulation of {accum} micro-batches a step"
        elif device_type != "cuda":
            why = f"the {device_type} device has no CUDA graphs"
        elif train.recompute not in (None, "none"):  # null: the memory plan decides later
            why = f"train.recompute={train.recompute}"
        elif train.compile:
            why = "train.compile=true"
        elif dp_size > 1:  # the all-reduce inside the captured step: opt in
            why = f"data parallel over {dp_size} ranks"
        graph = bool(master) and why is None
        if why:
            notices.append(
                f"train.cuda_graph: eager steps ({why}); set train.cuda_graph=true to force."
                if device_type == "cuda" and accum == 1
                else f"train.cuda_graph: eager steps ({why})."
            )
    return FastPath(
        bool(master), bool(graph), graph_auto=auto and bool(graph), notices=tuple(notices)
    )
