"""A policy outside the package, found by convention: ``families/toy_policy`` (its folder)
and ``families/conf/model/toy_policy_tiny.yaml`` (its YAML) on ``LONGBOAT_FAMILY_PATH``,
trained through the command line by the unchanged embodied run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from embodied_testkit import read_metrics

from longboat.core.config.errors import ConfigError
from longboat.core.family import Family, find_family
from longboat.embodied.cli import main
from longboat.embodied.models import build_model, policy, policy_names
from longboat.embodied.models.synthetic import synthetic_batch
from longboat.embodied.train.export import load_exported_policy

FAMILIES = Path(__file__).with_name("families")
TRAIN_DIR = Path(__file__).parents[1] / "src" / "longboat" / "embodied" / "train"


@pytest.fixture
def family_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONGBOAT_FAMILY_PATH", str(FAMILIES))


def test_a_family_path_folder_is_a_policy_and_only_with_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LONGBOAT_FAMILY_PATH", raising=False)
    assert policy_names() == ["groot_n1_6", "pi05", "smolvla"]
    monkeypatch.setenv("LONGBOAT_FAMILY_PATH", str(FAMILIES))
    assert policy_names() == ["groot_n1_6", "pi05", "smolvla", "toy_policy"]
    toy = policy("toy_policy")
    # core's one registry found it: a core Family of the embodied stack, imported by location
    assert isinstance(toy, Family) and toy.stack == "embodied"
    assert toy.model_class.__module__.startswith("longboat_family_path.toy_policy_")
    assert find_family("embodied", "toy_policy") is toy
    assert list(toy.flavors) == ["tiny"]
    model = build_model("toy_policy", "tiny")
    batch = synthetic_batch(model, 3, seed=0)
    assert tuple(batch["images"].shape) == (3, 2, 3, 24, 32)  # its synthetic_image_hw
    assert "embodiment_id" not in batch and "image_mask" not in batch
    assert tuple(model.predict_action(batch).shape) == (3, 4, 8)
    # Its FLOPs come from the family: 3 x forward of the trunk for the tiny shapes.
    assert toy.flops_per_sample(toy.flavor("tiny"), 2, (24, 32), 0) == 3 * 2 * (
        3 * 32 + 8 * 32 + 2 * 4 * 32 * 32 + 32 * 4 * 8
    )


def test_an_installed_package_names_its_policy_by_entry_point(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # An installed distribution: its dist-info on sys.path declares the entry point.
    monkeypatch.delenv("LONGBOAT_FAMILY_PATH", raising=False)
    info = tmp_path / "toy_policy_dist-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-policy-dist\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[longboat.families]\ntoy_policy = toy_policy:FAMILY\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(FAMILIES))
    assert policy_names() == ["groot_n1_6", "pi05", "smolvla", "toy_policy"]
    assert policy("toy_policy").model_class.__module__ == "toy_policy"


def test_the_builtin_policies_carry_what_the_run_asks_of_them() -> None:
    pi05, groot = policy("pi05"), policy("groot_n1_6")
    assert [f.name for f in pi05.export_formats] == ["lerobot"]
    assert [f.name for f in groot.export_formats] == ["isaac"]
    assert (pi05.action_width_key, groot.action_width_key) == ("action_dim", "max_action_dim")
    assert (pi05.synthetic_image_hw, groot.synthetic_image_hw) == ((56, 56), (56, 84))
    assert set(pi05.backbones.kinds) == {"paligemma", "siglip_vision_model", "siglip", "gemma"}
    assert set(groot.backbones.kinds) == {"siglip2_vision_model", "siglip2", "qwen3"}
    assert pi05.checkpoints.statistics is None and groot.checkpoints.statistics is not None
    assert dict(pi05.prompts.config_overrides) == {
        "state_in_prompt": True,
        "image.crop_fraction": 1.0,
    }
    assert dict(groot.prompts.config_overrides) == {"image_tokens_in_text": True}
    cfg = groot.flavor("tiny")
    spec = groot.batch_spec(cfg, 2, (56, 84))
    assert (spec.with_embodiment, spec.with_image_mask, spec.num_cameras) == (True, False, None)
    assert spec.vocab_limit == min(cfg.llm.vocab_size, cfg.image_token_id)


def test_the_toy_policy_trains_two_steps_through_the_cli(
    family_path: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "experiment=groot_n1_6_tiny",
            "model=toy_policy_tiny",
            f"output_dir={out}",
            "train.steps=2",
            "train.micro_batch_size=2",
            "train.global_batch_size=null",
            "train.log_every=1",
            "logging.run_name=toy",
            "logging.progress=false",
            "logging.trackers=[]",
            "data.synthetic.num_episodes=2",
            "data.synthetic.episode_length=12",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "Policy toy_policy/tiny:" in printed and "Trained steps 1..2" in printed
    rows = [r for r in read_metrics(out, "toy") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["loss"] > 0 for r in rows)
    # The native export loads back into the toy policy with the trained weights.
    exported = load_exported_policy(out / "export")
    assert type(exported).__name__ == "ToyPolicy"
    assert not (out / "export" / "lerobot").exists() and not (out / "export" / "isaac").exists()
    # It acts on a raw frame of its dataset through the processor saved beside it.
    from longboat.embodied.data import LeRobotDataset
    from longboat.embodied.inference import load_policy

    frame = LeRobotDataset(out / "dataset")[0]
    action = load_policy(out / "export").select_action(frame)
    assert action.shape == frame["action"].shape and bool(torch.isfinite(action).all())
    # Nothing under train/ names it: the run found it through the registry.
    assert not any("toy_policy" in p.read_text() for p in TRAIN_DIR.glob("*.py"))


def test_lora_defaults_come_from_the_family(family_path: None) -> None:
    """``lora.targets=[]`` reads ``PolicyFamily.lora_targets`` (the toy policy names none:
    every linear), and no module under train/ spells a policy's name to pick them."""
    from longboat.embodied.train.lora import apply_lora, lora_targets

    assert policy("toy_policy").lora_targets == ()
    assert lora_targets("toy_policy", []) == []
    model = build_model("toy_policy", "tiny")
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(apply_lora(model, [], rank=2, alpha=4.0, dropout=0.0)) == linears
    for name in policy_names():
        assert lora_targets(name, []) == list(policy(name).lora_targets)
        for path in TRAIN_DIR.glob("*.py"):
            assert f'"{name}"' not in path.read_text(), (name, path.name)


def test_an_unknown_policy_is_a_config_error_with_a_did_you_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match="did you mean 'pi05'"):
        build_model("pi5", "tiny")
    code = main(["train", "experiment=pi05_tiny", "model.name=pi5", f"output_dir={tmp_path}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "model.name" in err and "did you mean 'pi05'" in err
    assert not any(tmp_path.iterdir())  # refused before any work
