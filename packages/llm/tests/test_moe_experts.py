"""``model.moe_experts``: grouped experts by default, megatron's per-expert loop where LoRA
adapts the experts (with one line saying so), and an explicit ``grouped`` with LoRA on the
experts refused by name before the run starts."""

from __future__ import annotations

import dataclasses

import pytest
from llm_testkit import compose

from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import LoRAConfig
from longboat.core.family import find_family
from longboat.llm.moe_experts import moe_experts_for_run


def test_auto_is_grouped_unless_lora_adapts_the_experts() -> None:
    cfg = find_family("llm", "qwen3_moe").flavor("tiny")
    assert cfg.moe_experts == "auto"
    assert moe_experts_for_run(cfg) == (cfg, None)
    attention_only = LoRAConfig(enabled=True, targets=["linear_qkv", "linear_proj"])
    assert moe_experts_for_run(cfg, attention_only) == (cfg, None)

    resolved, notice = moe_experts_for_run(cfg, LoRAConfig(enabled=True))
    assert resolved.moe_experts == "sequential"
    assert notice is not None and notice.startswith("model.moe_experts: megatron's per-expert")
    assert "linear_fc1" in notice and "linear_fc2" in notice

    dense = find_family("llm", "qwen3").flavor(
        "tiny"
    )  # no experts: LoRA on the MLP changes nothing
    assert moe_experts_for_run(dense, LoRAConfig(enabled=True)) == (dense, None)


def test_explicit_grouped_with_lora_on_the_experts_is_refused() -> None:
    cfg = dataclasses.replace(find_family("llm", "qwen3_moe").flavor("tiny"), moe_experts="grouped")
    with pytest.raises(ConfigError) as err:
        moe_experts_for_run(cfg, LoRAConfig(enabled=True, targets=["linear_fc2"]))
    assert "model.moe_experts" in str(err.value) and "linear_fc2" in str(err.value)
    bad = dataclasses.replace(cfg, moe_experts="loop")
    with pytest.raises(ConfigError, match=r"model\.moe_experts"):
        moe_experts_for_run(bad)


def test_validator_names_the_key_before_the_run_starts() -> None:
    base = ["model=qwen3_moe_tiny", "lora.enabled=true"]
    with pytest.raises(ConfigError) as err:
        compose([*base, "model.moe_experts=grouped"])
    assert "model.moe_experts" in str(err.value) and "lora.targets" in str(err.value)
    assert compose([*base, "model.moe_experts=sequential"]).model.moe_experts == "sequential"
    assert compose(["model=qwen3_moe_tiny"]).model.moe_experts == "auto"
