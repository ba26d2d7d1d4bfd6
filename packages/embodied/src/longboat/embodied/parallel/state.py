"""Checkpointable views of a parallelized model and its optimizer (DCP ``Stateful``).

Keys are parameter FQNs of the user's module (no ``module.`` or checkpoint-wrapper
prefixes), so a checkpoint written under one strategy or world size loads under
another: DCP reshards the tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from longboat.embodied.parallel.optim import consolidated_zero_state
from longboat.embodied.parallel.strategy import unwrap

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def clean_fqn(name: str) -> str:
    """Parameter name without DDP / checkpoint-wrapper / compile prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class ModelState:
    """The model's parameters and buffers (sharded DTensors stay sharded)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState:
    """Optimizer state keyed by parameter FQN; ZeRO-1 state is gathered to full first."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return self._zero_state_dict()
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            self._zero_load_state_dict(state_dict)
            return
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)

    # ZeRO-1: torch's DCP helpers do not understand ZeroRedundancyOptimizer, so
    # convert its consolidated (index-keyed) state to the FQN-keyed layout.
    def _ordered_params(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _fqns(self) -> list[str]:
        names = {id(p): clean_fqn(n) for n, p in unwrap(self.model).named_parameters()}
        return [names[id(p)] for p in self._ordered_params()]

    def _ensure_state(self) -> None:
        """Materialise empty optimizer state (a zero-lr step on zero grads) as a load template."""
        if any(len(o.state) for o in [self.optimizer.optim]):
            return
        saved = [g["lr"] for g in self.optimizer.param_groups]
        params = self._ordered_params()
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        grads = [p.grad for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for p, g in zip(params, grads):
            p.grad = g
        for group, lr in zip(self.optimizer.param_groups, saved):
            group["lr"] = lr

    def _zero_state_dict(self) -> dict[str, Any]:
        self._ensure_state()
        full = consolidated_zero_state(self.optimizer)
        fqns = self._fqns()
        state = {fqns[idx]: value for idx, value in full["state"].items()}
        groups = []
        for group in full["param_groups"]:
            group = dict(group)
            group["params"] = [fqns[idx] for idx in group["params"]]
            groups.append(group)
        return {"state": state, "param_groups": groups}

    def _zero_load_state_dict(self, state_dict: dict[str, Any]) -> None:
        index = {fqn: idx for idx, fqn in enumerate(self._fqns())}
        groups = []
        for group in state_dict["param_groups"]:
            group = dict(group)
            group["params"] = [index[fqn] for fqn in group["params"]]
            groups.append(group)
        state = {index[fqn]: value for fqn, value in state_dict["state"].items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
