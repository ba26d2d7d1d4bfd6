"""Registry, flavors, config-group YAML and HF config translation (no megatron init)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from longboat.core.config.errors import ConfigError
from longboat.core.family import find_family, list_families
from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.llm.hf_checkpoint import family_for_hf_config
from longboat.llm.stack import STACK

CONF = Path(STACK.config_dir) / "model"

EXPECTED_FLAVORS = {
    "llama3": {"tiny", "1b", "8b", "70b"},
    "qwen3": {"tiny", "0.6b", "1.7b", "8b", "32b"},
    "qwen3_moe": {"tiny", "30b_a3b"},
    "deepseek_v3": {"tiny", "moonlight_16b_a3b", "671b", "kimi_k2", "v32_tiny", "v32"},
}


def test_registry_lists_every_family_and_flavor() -> None:
    assert list_families("llm") == sorted(EXPECTED_FLAVORS)
    for name, flavors in EXPECTED_FLAVORS.items():
        assert set(find_family("llm", name).flavors) == flavors


def test_unknown_names_fail_with_the_choices() -> None:
    with pytest.raises(ConfigError, match="llama3"):
        find_family("llm", "llama4")
    with pytest.raises(ConfigError, match=r"\['1b', '70b', '8b', 'tiny'\]"):
        find_family("llm", "llama3").flavor("405b")


@pytest.mark.parametrize(
    ("family", "flavor", "params_b"),
    [
        ("llama3", "1b", 1.24),
        ("llama3", "8b", 8.03),
        ("llama3", "70b", 70.55),
        ("qwen3", "0.6b", 0.60),
        ("qwen3", "1.7b", 1.72),
        ("qwen3", "8b", 8.19),
        ("qwen3", "32b", 32.76),
        ("qwen3_moe", "30b_a3b", 30.53),
    ],
)
def test_real_flavors_have_the_published_parameter_count(
    family: str, flavor: str, params_b: float
) -> None:
    c = find_family("llm", family).flavor(flavor)
    h, d = c.hidden_size, c.head_dim
    attn = h * d * (2 * c.num_attention_heads + 2 * c.num_query_groups)
    attn += 2 * d if c.qk_norm else 0
    if c.num_experts:
        mlp = c.num_experts * 3 * h * c.moe_ffn_hidden_size + c.num_experts * h
    else:
        mlp = 3 * h * c.ffn_hidden_size
    total = c.num_layers * (attn + mlp + 2 * h) + h + c.vocab_size * h
    total += 0 if c.tie_embeddings else c.vocab_size * h
    assert total / 1e9 == pytest.approx(params_b, abs=0.01)


def test_tied_embeddings_follow_the_real_models() -> None:
    assert find_family("llm", "llama3").flavor("1b").tie_embeddings
    assert not find_family("llm", "llama3").flavor("8b").tie_embeddings
    assert find_family("llm", "qwen3").flavor("0.6b").tie_embeddings
    assert find_family("llm", "qwen3").flavor("1.7b").tie_embeddings
    assert not find_family("llm", "qwen3").flavor("8b").tie_embeddings
    assert not find_family("llm", "qwen3").flavor("32b").tie_embeddings


def test_yaml_flavors_equal_python_flavors() -> None:
    seen = set()
    for path in sorted(CONF.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        fam = find_family("llm", data["name"])
        flavor = str(data["flavor"])
        # model.init_from is where a run starts, not part of a flavor's shape
        shape = {
            k: v for k, v in dataclasses.asdict(fam.flavor(flavor)).items() if k != "init_from"
        }
        assert shape == data, path.name
        assert path.stem == f"{data['name']}_{flavor.replace('.', '_')}"
        seen.add((data["name"], flavor))
    assert seen == {(f, v) for f, vs in EXPECTED_FLAVORS.items() for v in vs}


@pytest.mark.parametrize("family", sorted(EXPECTED_FLAVORS))
def test_hf_config_round_trip(family: str, tmp_path: Path) -> None:
    fam = find_family("llm", family)
    for flavor in fam.flavors:
        cfg = fam.flavor(flavor)
        fam.to_hf_config(cfg).save_pretrained(tmp_path)
        hf = json.loads((tmp_path / "config.json").read_text())
        assert family_for_hf_config(hf) is fam
        back = fam.from_hf_config(hf)
        assert dataclasses.replace(back, flavor=cfg.flavor) == cfg, flavor


def test_unsupported_rope_scaling_is_rejected() -> None:
    fam = find_family("llm", "llama3")
    hf = fam.to_hf_config(fam.flavor("8b")).to_dict()
    hf["rope_parameters"]["high_freq_factor"] = 2.0
    with pytest.raises(ConfigError, match="high_freq_factor"):
        fam.from_hf_config(hf)


def test_validator_reports_bad_parallel_sizes() -> None:
    from longboat.core.config.errors import ProblemCollector
    from longboat.llm.validate import validate_llm

    model = dataclasses.asdict(find_family("llm", "qwen3_moe").flavor("tiny"))
    problems = ProblemCollector()
    validate_llm(
        {"model": model, "parallel": {"tensor_parallel": 3, "expert_parallel": 3}}, 6, problems
    )
    with pytest.raises(ConfigError) as info:
        problems.raise_if_any()
    text = str(info.value)
    assert "parallel.tensor_parallel=3" in text and "parallel.expert_parallel=3" in text


def test_default_model_config_is_llama3_tiny_shape() -> None:
    assert DecoderModelConfig().num_layers == 2


def test_declared_transformers_range_is_the_one_the_export_is_read_by() -> None:
    """The export writes transformers 5.x's config layout (rope_parameters), which 4.x reads
    wrongly: the install must not allow 4.x."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    (req,) = [
        Requirement(r) for r in md.requires("longboat-llm") or [] if r.startswith("transformers")
    ]
    assert not req.specifier.contains("4.57.0") and req.specifier.contains("5.17.0")
    assert req.specifier.contains(md.version("transformers"))
