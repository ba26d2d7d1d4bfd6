"""Which modules the strategies shard and checkpoint (the FSDP / activation-checkpointing unit)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from longboat.core.config.errors import ConfigError
from longboat.embodied.models import build_model, get_config
from longboat.embodied.parallel import apply_activation_checkpointing, block_methods, find_blocks


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(
            nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)])) for _ in range(2)
        )
        self.head = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))


class _Declared(_Nested):
    def parallel_blocks(self) -> list[nn.Module]:
        return list(self.head)


class _MethodLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(2, 2)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_fallback_takes_outermost_module_list_elements() -> None:
    model = _Nested()
    assert find_blocks(model) == [*model.encoder, *model.head]  # inner lists not split again


def test_declared_parallel_blocks_win() -> None:
    model = _Declared()
    assert find_blocks(model) == list(model.head)


def test_block_methods_are_detected() -> None:
    assert block_methods(_MethodLayer()) == ["project_qkv", "finish"]
    assert block_methods(nn.Linear(2, 2)) == []


@pytest.mark.parametrize(("mode", "wrapped"), [("none", 0), ("full", 5), ("selective", 3)])
def test_activation_checkpointing_modes(mode: str, wrapped: int) -> None:
    model = _Nested()
    assert apply_activation_checkpointing(model, find_blocks(model), mode) == wrapped
    wrappers = [n for n, _ in model.named_modules() if n.endswith("_checkpoint_wrapped_module")]
    assert len(wrappers) == wrapped


def test_unknown_checkpointing_mode_names_the_key() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"train\.recompute"):
        apply_activation_checkpointing(model, [], "some")


def _policy_batch(name: str, cfg: object) -> dict:
    path = Path(__file__).with_name("test_parallel_policies.py")
    spec = importlib.util.spec_from_file_location("_policies_helpers", path)
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    from longboat.embodied.train.policy_batch import PolicyCollator, batch_spec

    collate = PolicyCollator(
        batch_spec(name, cfg, len(helpers.CAMERAS), helpers.IMAGE_HW[name]), helpers.CAMERAS
    )
    return collate(helpers._samples(name, cfg.action_horizon, 2))


@pytest.mark.parametrize("name", ["groot_n1_6", "pi05", "smolvla"])
def test_every_block_of_the_real_policies_is_entered(name: str) -> None:
    """FSDP gathers a block's shards in hooks on its forward (or registered methods): every
    block must actually be entered that way in a training forward, or it would run on shards."""
    cfg = get_config(name, "tiny")
    model = build_model(name, cfg)
    blocks = find_blocks(model)
    assert len(blocks) >= 6
    entered: set[int] = set()
    for block in blocks:
        block.register_forward_pre_hook(lambda mod, args: entered.add(id(mod)))
        for method in block_methods(block):
            original, block_id = getattr(block, method), id(block)

            def traced(*a, _orig=original, _id=block_id, **k):
                entered.add(_id)
                return _orig(*a, **k)

            setattr(block, method, traced)
    model(_policy_batch(name, cfg))["loss"].backward()
    missed = [n for n, m in model.named_modules() if m in blocks and id(m) not in entered]
    assert not missed
