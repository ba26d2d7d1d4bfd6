"""Hydra composition across stacks found through a real ``longboat.stacks`` entry point."""

from __future__ import annotations

import uuid
import warnings

import pytest
from fake_stack import write_fake_stack
from omegaconf import OmegaConf

from longboat.core.config.compose import compose_experiment, list_experiments, to_dataclass
from longboat.core.config.errors import ConfigError
from longboat.core.stack import CORE_STACK, Stack, discover_stacks, get_stack


@pytest.fixture
def fake(tmp_path, monkeypatch) -> str:
    """Install stack ``fake`` via a dist-info on sys.path; return its module name."""
    module = f"fake_stack_{uuid.uuid4().hex[:8]}"
    write_fake_stack(tmp_path / "site", "fake", module=module)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return module


def test_discover_finds_core_and_the_installed_fake_stack(fake):
    stacks = discover_stacks()
    assert next(iter(stacks)) == "core"
    assert stacks["core"] is CORE_STACK
    fake_stack = stacks["fake"]
    assert isinstance(fake_stack, Stack)
    assert fake_stack.description == "Fake stack for tests."
    assert fake_stack.experiments() == ["no_model", "not_global", "tiny"]
    assert list_experiments(stacks)["fake"] == ["no_model", "not_global", "tiny"]
    assert "tiny" not in list_experiments(stacks)["core"]


def test_stack_absent_until_installed(tmp_path):
    write_fake_stack(tmp_path / "site", "notinstalled", module=f"m_{uuid.uuid4().hex[:8]}")
    assert "notinstalled" not in discover_stacks()  # written but not on sys.path


def test_broken_entry_point_is_skipped_with_a_warning(tmp_path, monkeypatch):
    dist = tmp_path / "site" / "broken_stack-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-stack\nVersion: 0.1\n")
    missing = f"no_such_module_{uuid.uuid4().hex[:8]}"
    (dist / "entry_points.txt").write_text(f"[longboat.stacks]\nbroken = {missing}:STACK\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.warns(UserWarning, match="'broken'.*failed to load"):
        stacks = discover_stacks()
    assert "broken" not in stacks and "core" in stacks


def test_get_stack_suggests_installed_names(fake):
    with pytest.raises(ConfigError, match="did you mean 'fake'"):
        get_stack("fak")


def test_compose_experiment_applies_recipe_group_and_key_overrides(fake):
    cfg = compose_experiment("tiny", ["optim=sgd", "optim.lr=0.5", "model.num_layers=12"])
    assert cfg.stack == "fake" and cfg.experiment == "tiny"
    assert cfg.train.steps == 5  # from experiment/tiny.yaml
    assert cfg.train.global_batch_size == 8
    assert cfg.optim.name == "sgd"  # group option optim/sgd.yaml (core)
    assert cfg.optim.schedule.name == "constant"  # ...including its nested keys
    assert cfg.optim.lr == 0.5  # key override wins over the group option (0.01)
    assert cfg.optim.eps == 1e-8  # not in any YAML: schema default
    assert cfg.model.num_layers == 12
    assert cfg.model.hidden_size == 64
    assert cfg.checkpoint.dir == "outputs/fake/checkpoints"  # ${output_dir} resolved
    # Types come from the schemas the stack registered.
    mod = __import__(fake)
    assert OmegaConf.get_type(cfg) is mod.FakeExperimentConfig
    assert OmegaConf.get_type(cfg.model) is mod.GPTConfig
    obj = to_dataclass(cfg)
    assert isinstance(obj, mod.FakeExperimentConfig) and isinstance(obj.model, mod.GPTConfig)
    assert obj.model.num_layers == 12


def test_key_override_of_a_field_no_yaml_sets_and_delete(fake):
    cfg = compose_experiment("tiny", ["train.nan_guard.max_consecutive=9", "~train.steps"])
    assert cfg.train.nan_guard.max_consecutive == 9
    assert cfg.train.steps == 100  # deleted from the recipe -> schema default


def test_overrides_convert_like_omegaconf(fake):
    cfg = compose_experiment("tiny", ["train.steps='7'", "optim.lr=1", "logging.run_name=42"])
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.logging.run_name == "42"


def test_data_schema_by_name_is_resolved_lazily(fake):
    cfg = compose_experiment("tiny", ["data=files", "data.seq_length=64"])
    assert OmegaConf.get_type(cfg.data).__name__ == "FilesDataConfig"
    assert cfg.data.seq_length == 64
    with pytest.raises(ConfigError, match=r"data\.seq_len=3: unknown key.*'data\.seq_length'"):
        compose_experiment("tiny", ["data=files", "data.seq_len=3"])


def test_misspelled_key_gets_did_you_mean_with_full_path(fake):
    with pytest.raises(ConfigError) as info:
        compose_experiment("tiny", ["optim.lrr=0.1"])
    text = str(info.value)
    assert "optim.lrr=0.1: unknown key" in text
    assert "did you mean 'optim.lr'?" in text
    assert info.value.keys == ["optim.lrr"]


def test_key_in_the_wrong_group_points_at_the_right_one(fake):
    with pytest.raises(ConfigError, match=r"train\.lr=0\.1: unknown key.*did you mean 'optim\.lr'"):
        compose_experiment("tiny", ["train.lr=0.1"])


def test_misspelled_group_reports_leaf_path(fake):
    with pytest.raises(ConfigError, match=r"trian\.steps=3: unknown key.*'train\.steps'"):
        compose_experiment("tiny", ["trian.steps=3"])


def test_model_keys_are_checked_against_the_model_schema(fake):
    with pytest.raises(ConfigError) as info:
        compose_experiment("tiny", ["model.num_heads=8"])
    assert "model.num_heads=8: unknown key" in str(info.value)
    assert "did you mean 'model.num_attention_heads'" in str(info.value)


def test_type_error_names_key_value_and_expected_type(fake):
    with pytest.raises(ConfigError) as info:
        compose_experiment("tiny", ["train.steps=abc", "optim.betas=oops", "train.compile=3"])
    text = str(info.value)
    assert "train.steps='abc': expected int, got str" in text
    assert "optim.betas='oops': expected list[float], got str" in text
    assert "train.compile=3: expected bool, got int" in text
    assert info.value.keys == ["optim.betas", "train.steps", "train.compile"]


def test_unknown_group_option_and_experiment_get_suggestions(fake):
    with pytest.raises(ConfigError, match=r"optim='sgdd': no such option.*did you mean 'sgd'"):
        compose_experiment("tiny", ["optim=sgdd"])
    with pytest.raises(ConfigError, match=r"experiment='tny'.*did you mean 'tiny'"):
        compose_experiment("tny", [])
    with pytest.raises(ConfigError, match=r"stack 'core' has no such experiment"):
        compose_experiment("tiny", [], stack="core")


def test_missing_model_lists_the_options(fake):
    with pytest.raises(
        ConfigError, match=r"model\.name: required value is not set.*model=<option>.*gpt"
    ):
        compose_experiment("no_model", [])
    cfg = compose_experiment("no_model", ["model=gpt"])
    assert cfg.model.name == "gpt" and cfg.train.steps == 3


def test_experiment_without_global_package_is_explained(fake):
    with pytest.raises(ConfigError, match="# @package _global_"):
        compose_experiment("not_global", [])


def test_unparseable_and_sweep_overrides_are_reported(fake):
    with pytest.raises(ConfigError) as info:
        compose_experiment("tiny", ["train.steps=1,2", "=oops", "x=[1,"])
    assert len(info.value.problems) == 3
    assert "cannot parse override" in str(info.value)
    assert "is a sweep (train.steps=1,2) Fix: add -m (--multirun)" in str(info.value)
    assert "override has no key" in str(info.value)


def test_several_problems_are_reported_together(fake):
    with pytest.raises(ConfigError) as info:
        compose_experiment(
            "tiny",
            ["optim.lrr=1", "train.steps=abc", "parallel.tensor_parallel=3", "data.path=/nope/x"],
            world_size=4,
        )
    err = info.value
    assert err.keys == [
        "optim.lrr",
        "train.steps",
        "parallel",  # 4 processes cannot hold tp=3
        "parallel.tensor_parallel",  # 3 does not divide 4 heads
        "parallel.tensor_parallel",  # ... nor 2 KV heads
        "data.path",
    ]
    assert str(err).startswith("Invalid config (6 problems):")


def test_stack_validators_run(fake):
    with pytest.raises(ConfigError, match="output_dir='': must not be empty"):
        compose_experiment("tiny", ["output_dir=''"])


def test_unregistered_model_is_typed_on_base_fields_only(tmp_path, monkeypatch, fake):
    conf = tmp_path / "site" / f"{fake}_conf"
    (conf / "model" / "mystery.yaml").write_text("name: mystery\nwidth: 3\n")
    with pytest.warns(UserWarning, match="no stack registers a schema for model.name='mystery'"):
        cfg = compose_experiment("tiny", ["model=mystery"])
    assert cfg.model.width == 3 and cfg.model.flavor == "tiny"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=r"model\.flavor=\[1\]: expected str"):
            compose_experiment("tiny", ["model=mystery", "model.flavor=[1]"])


def test_model_name_close_to_a_registered_one_is_an_error(fake):
    with pytest.raises(
        ConfigError, match=r"model\.name='gtp': no installed stack.*did you mean 'gpt'"
    ):
        compose_experiment("tiny", ["model.name=gtp"])


def test_core_demo_experiment_is_checked_against_the_demo_schemas():
    demo = pytest.importorskip("longboat.core.demo")
    cfg = compose_experiment("demo", ["model.hidden_size=32"], stack="core")
    assert OmegaConf.get_type(cfg.model) is demo.MLPConfig
    assert OmegaConf.get_type(cfg.data) is demo.SyntheticRegressionConfig
    assert cfg.model.hidden_size == 32 and cfg.stack == "core"
    with pytest.raises(
        ConfigError, match=r"model\.hiden_size=3: unknown key.*'model\.hidden_size'"
    ):
        compose_experiment("demo", ["model.hiden_size=3"], stack="core")


def test_bad_interpolations_are_all_reported(fake):
    with pytest.raises(ConfigError) as info:
        compose_experiment("tiny", ["train.steps=${logging.run_name}", "train.seed=${nope.x}"])
    assert info.value.keys == ["train.steps", "train.seed"]
    text = str(info.value)
    assert "Value 'run' of type 'str' could not be converted to Integer" in text
    assert "Interpolation key 'nope.x' not found" in text
