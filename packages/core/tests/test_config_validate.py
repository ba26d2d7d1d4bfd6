"""Cross-field validation: each rule, with the message text users will read."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from longboat.core.config.errors import ConfigError, ConfigProblem, ProblemCollector
from longboat.core.config.schema import ExperimentConfig, ModelConfig, ParallelConfig, TrainConfig
from longboat.core.config.validate import collect_problems, validate
from longboat.core.stack import Stack


@dataclass
class DecoderConfig(ModelConfig):
    name: str = "decoder"
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    num_hidden_layers: int = 12
    num_experts: int = 0


def make(
    tp=1, pp=1, cp=1, ep=1, dp=-1, vpp=None, mbs=1, gbs=None, model=None, **kw
) -> ExperimentConfig:
    cfg = ExperimentConfig(
        model=model or DecoderConfig(),
        parallel=ParallelConfig(
            tensor_parallel=tp,
            pipeline_parallel=pp,
            context_parallel=cp,
            expert_parallel=ep,
            data_parallel=dp,
            virtual_pipeline_parallel=vpp,
        ),
        train=TrainConfig(micro_batch_size=mbs, global_batch_size=gbs),
        **kw,
    )
    return cfg


def only_problem(cfg, world_size=None) -> ConfigProblem:
    problems = collect_problems(cfg, world_size, stacks={})
    assert len(problems) == 1, problems
    return problems[0]


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_defaults_are_valid_at_every_world_size():
    for world_size in (None, 1, 2, 8):
        validate(make(), world_size=world_size)


def test_world_size_must_equal_tp_pp_cp_dp():
    problem = only_problem(make(tp=2, pp=2, dp=3), world_size=8)
    assert problem.key == "parallel.data_parallel"
    assert problem.value == 3
    assert "world size 8 != tp=2 x pp=2 x cp=1 x dp=3 = 12" in problem.message
    assert "parallel.data_parallel=2 or -1" in problem.fix
    validate(make(tp=2, pp=2, dp=2), world_size=8)
    validate(make(tp=2, pp=2, dp=-1), world_size=8)  # inferred dp=2


def test_world_size_not_divisible_by_model_parallel():
    problem = only_problem(make(tp=2, cp=2), world_size=6)
    assert problem.key == "parallel"
    assert "world size 6 is not divisible by tp=2 x pp=1 x cp=2 = 4" in problem.message


def test_world_size_comes_from_torchrun_env(monkeypatch):
    validate(make(tp=2), world_size=None)  # unknown world size: layout not checked
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="world size 3 is not divisible by tp=2"):
        validate(make(tp=2))


def test_tp_must_divide_attention_heads_and_kv_heads():
    model = DecoderConfig(num_attention_heads=6, num_key_value_heads=2)
    problems = collect_problems(make(tp=4, model=model), 4, stacks={})
    assert [(p.key, p.value, p.message) for p in problems] == [
        ("parallel.tensor_parallel", 4, "does not divide model.num_attention_heads=6"),
        ("parallel.tensor_parallel", 4, "does not divide model.num_key_value_heads=2"),
    ]
    validate(make(tp=2, model=model), world_size=4)


def test_num_heads_spelling_is_recognised():
    @dataclass
    class ViT(ModelConfig):
        name: str = "vit"
        num_heads: int = 6

    problem = only_problem(make(tp=4, model=ViT()), world_size=4)
    assert problem.message == "does not divide model.num_heads=6"


def test_pp_must_divide_layers_with_and_without_virtual_stages():
    problem = only_problem(make(pp=5), world_size=5)
    assert problem.key == "parallel.pipeline_parallel"
    assert problem.message == "pp=5 does not divide model.num_hidden_layers=12"
    problem = only_problem(make(pp=2, vpp=4), world_size=2)
    assert problem.message == "pp=2 x vpp=4 does not divide model.num_hidden_layers=12"
    validate(make(pp=2, vpp=3), world_size=2)


def test_ep_must_divide_experts():
    problem = only_problem(make(ep=3, model=DecoderConfig(num_experts=8)), world_size=3)
    assert (problem.key, problem.value) == ("parallel.expert_parallel", 3)
    assert problem.message == "does not divide model.num_experts=8"
    validate(make(ep=4, model=DecoderConfig(num_experts=8)), world_size=4)
    # EP groups come out of tp x dp x cp ranks: ep=4 needs tp*dp*cp divisible by 4.
    problem = only_problem(make(ep=4, model=DecoderConfig(num_experts=8)), world_size=2)
    assert problem.message == "does not divide tensor x data x context parallel = 1 x 2 x 1"
    validate(make(ep=4, tp=2, model=DecoderConfig(num_experts=8)), world_size=4)
    validate(make(ep=4, tp=2, cp=2, model=DecoderConfig(num_experts=8)), world_size=8)


def test_global_batch_divisible_by_micro_batch_times_dp():
    problem = only_problem(make(mbs=2, gbs=10), world_size=2)
    assert problem.key == "train.global_batch_size" and problem.value == 10
    assert problem.message == "is not divisible by micro_batch_size=2 x data_parallel=2 = 4"
    assert "multiple of 4" in problem.fix
    validate(make(mbs=2, gbs=12), world_size=2)  # 3 accumulation steps
    validate(make(mbs=2, gbs=10, tp=2), world_size=2)  # dp=1 -> 10 % 2 == 0


def test_missing_paths(tmp_path):
    cfg = make()
    cfg.data.path = str(tmp_path / "nope")
    cfg.checkpoint.resume = str(tmp_path / "step_00000010")
    problems = collect_problems(cfg, stacks={})
    assert [p.key for p in problems] == ["data.path", "checkpoint.resume"]
    assert problems[0].value == str(tmp_path / "nope")
    (tmp_path / "nope").mkdir()
    (tmp_path / "step_00000010").mkdir()
    validate(cfg)
    for special in ("auto", "none"):
        cfg.checkpoint.resume = special
        validate(cfg)


def test_closed_choices_and_ranges():
    cfg = make()
    cfg.train.precision = "fp4"
    cfg.parallel.strategy = "zero3"
    cfg.train.steps = 0
    cfg.optim.betas = [0.9]
    problems = collect_problems(cfg, stacks={})
    assert {p.key: p.value for p in problems} == {
        "parallel.strategy": "zero3",
        "train.precision": "fp4",
        "train.steps": 0,
        "optim.betas": [0.9],
    }
    assert "use one of: fp32, bf16, fp16, fp8" in next(p.fix for p in problems if p.value == "fp4")


def test_hsdp_replicas():
    cfg = make()
    cfg.parallel.data_parallel_replicate = 2
    assert only_problem(cfg, 4).message.startswith("only applies to strategy=hsdp")
    cfg.parallel.strategy = "hsdp"
    validate(cfg, world_size=4)
    assert only_problem(cfg, 3).message == "does not divide the data-parallel size 3"


def test_all_problems_in_one_error(tmp_path):
    cfg = make(tp=3, pp=5, mbs=2, gbs=7)
    cfg.data.path = str(tmp_path / "missing")
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=4)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.keys == [
        "parallel",
        "parallel.tensor_parallel",
        "parallel.tensor_parallel",
        "parallel.pipeline_parallel",
        "train.global_batch_size",
        "data.path",
    ]
    text = str(err)
    assert text.startswith("Invalid config (6 problems):\n  - parallel: world size 4")
    assert "  - data.path=" in text and "Fix: point data.path at an existing" in text


def test_stack_validators_receive_the_config_and_world_size():
    seen = []

    def rule(cfg, world_size, problems: ProblemCollector):
        seen.append((cfg.model.name, world_size))
        problems.add("extra.flag", "is required by this stack", fix="set extra.flag=1")

    stacks = {"mystack": Stack(name="mystack", description="", validators=(rule,))}
    cfg = make(stack="mystack")
    problems = collect_problems(cfg, 2, stacks=stacks)
    assert seen == [("decoder", 2)]
    assert [p.format() for p in problems] == [
        "extra.flag: is required by this stack Fix: set extra.flag=1"
    ]


def test_accepts_dictconfig_and_mapping():
    from omegaconf import OmegaConf

    bad = {"parallel": {"tensor_parallel": 3}, "model": {"name": "x", "num_heads": 4}}
    for cfg in (bad, OmegaConf.create(bad)):
        assert only_problem(cfg).message == "does not divide model.num_heads=4"


def test_collected_problems_keep_their_fields():
    err = ConfigError([ConfigProblem("a.b", "bad", 3, "use 4"), ConfigProblem(None, "other")])
    assert str(err) == "Invalid config (2 problems):\n  - a.b=3: bad Fix: use 4\n  - other"
    one = ConfigError("must be positive", key="train.steps", value=-1, fix="set train.steps=1")
    assert str(one) == "Invalid config: train.steps=-1: must be positive Fix: set train.steps=1"
    assert one.problems[0].value == -1 and one.keys == ["train.steps"]
    assert str(ConfigError("plain words")) == "Invalid config: plain words"
    with pytest.raises(ValueError):
        ConfigError([])
