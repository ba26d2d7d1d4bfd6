"""The family registry: what ``find_family`` / ``list_families`` return for families found by
convention (the stack's ``families_package``), by ``longboat.families`` entry point and by
``LONGBOAT_FAMILY_PATH``, and the errors for unknown names and flavors."""

from __future__ import annotations

import textwrap
import uuid
import warnings
from pathlib import Path

import pytest
from fake_stack import write_fake_stack

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.family import (
    FAMILY_PATH_ENV,
    Family,
    family_for_checkpoint,
    find_family,
    list_families,
)

FAMILY_MODULE = """\
from dataclasses import dataclass

from longboat.core.config.schema import ModelConfig
from longboat.core.family import Family


@dataclass
class {cls}(ModelConfig):
    width: int = 8


FAMILY = Family(
    name={name!r},
    stack={stack!r},
    schema={cls},
    flavors={{"tiny": {cls}(name={name!r}, width=8), "big": {cls}(name={name!r}, width=64)}},
    checkpoint_types=({ckpt!r},),
    flops_per_sample=lambda cfg, seq_len: 6.0 * cfg.width * seq_len,
)
"""


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def fake(tmp_path, monkeypatch) -> str:
    """Stack ``fake`` whose ``families_package`` holds family ``alpha`` (plus a helper package
    without ``FAMILY`` and a plain module, both skipped), and a distribution whose
    ``longboat.families`` entry point gives family ``beta``."""
    tag = uuid.uuid4().hex[:8]
    site = tmp_path / "site"
    module = f"fake_stack_{tag}"
    write_fake_stack(site, "fake", module=module)
    models = f"fake_models_{tag}"
    stack_file = site / f"{module}.py"
    stack_file.write_text(
        stack_file.read_text().replace(
            "    console_script=", f"    families_package={models!r},\n    console_script="
        )
    )
    _write(site / models / "__init__.py", "")
    _write(
        site / models / "alpha" / "__init__.py",
        FAMILY_MODULE.format(cls="AlphaConfig", name="alpha", stack="fake", ckpt="alpha_hf"),
    )
    _write(site / models / "helpers" / "__init__.py", "VALUE = 1\n")
    _write(site / models / "common.py", "FAMILY = None\n")
    ep_module = f"beta_family_{tag}"
    beta = FAMILY_MODULE.format(cls="BetaConfig", name="beta", stack="fake", ckpt="beta_hf")
    beta = beta.replace(
        "    flops_per_sample=",
        f"    config_dir=Path({str(site / 'beta_conf')!r}),\n    flops_per_sample=",
    )
    _write(site / f"{ep_module}.py", "from pathlib import Path\n" + beta)
    _write(site / "beta_conf" / "model" / "beta_small.yaml", "name: beta\nflavor: tiny\nwidth: 4\n")
    dist = site / f"{ep_module}-0.1.dist-info"
    _write(dist / "METADATA", f"Metadata-Version: 2.1\nName: {ep_module}\nVersion: 0.1\n")
    _write(dist / "entry_points.txt", f"[longboat.families]\nbeta = {ep_module}:FAMILY\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(FAMILY_PATH_ENV, raising=False)
    return module


@pytest.fixture
def family_path(tmp_path, monkeypatch) -> Path:
    """A ``LONGBOAT_FAMILY_PATH`` folder with family ``gamma`` and its model YAML."""
    folder = tmp_path / "my_models"
    _write(
        folder / "gamma" / "__init__.py",
        "from .config import FAMILY\n",
    )
    _write(
        folder / "gamma" / "config.py",
        FAMILY_MODULE.format(cls="GammaConfig", name="gamma", stack="fake", ckpt="gamma_hf"),
    )
    _write(folder / "conf" / "model" / "gamma_tiny.yaml", "name: gamma\nflavor: tiny\nwidth: 16\n")
    _write(folder / "notes" / "README.md", "not a package\n")
    monkeypatch.setenv(FAMILY_PATH_ENV, str(folder))
    return folder


def test_convention_and_entry_point_families(fake):
    assert list_families("fake") == ["alpha", "beta"]
    alpha = find_family("fake", "alpha")
    assert isinstance(alpha, Family)
    assert (alpha.name, alpha.stack) == ("alpha", "fake")
    assert alpha.schema.__name__ == "AlphaConfig"
    assert sorted(alpha.flavors) == ["big", "tiny"]
    assert alpha.flavor("big").width == 64
    assert alpha.flavor("tiny") is not alpha.flavors["tiny"]  # a copy
    assert alpha.flops_per_sample(alpha.flavor("tiny"), seq_len=10) == 480.0
    assert find_family("fake", "beta").schema.__name__ == "BetaConfig"
    assert list_families("core") == []


def test_an_entry_point_family_brings_its_yaml(fake):
    cfg = compose_experiment("tiny", ["model=beta_small"])
    assert (cfg.model.name, cfg.model.width) == ("beta", 4)
    assert cfg.model._metadata.object_type.__name__ == "BetaConfig"


def test_unknown_name_and_flavor_are_config_errors_with_a_did_you_mean(fake):
    with pytest.raises(ConfigError) as exc:
        find_family("fake", "alpah")
    text = str(exc.value)
    assert "model.name" in text and "did you mean 'alpha'?" in text and "beta" in text
    with pytest.raises(ConfigError) as exc:
        find_family("fake", "alpha").flavor("bgi")
    assert "model.flavor" in str(exc.value) and "did you mean 'big'?" in str(exc.value)


def test_checkpoint_identifiers_pick_the_family(fake):
    assert family_for_checkpoint("fake", ["x", "beta_hf"], key="k", where="w").name == "beta"
    with pytest.raises(ConfigError) as exc:
        family_for_checkpoint("fake", ["nope"], key="model.init_from", where="dir/config.json")
    assert "model.init_from" in str(exc.value) and "['alpha_hf', 'beta_hf']" in str(exc.value)


def test_family_path_folder_adds_a_family_and_its_yaml(fake, family_path):
    assert list_families("fake") == ["alpha", "beta", "gamma"]
    gamma = find_family("fake", "gamma")
    assert gamma.schema.__name__ == "GammaConfig"
    # the folder's conf/ joins the search path and the family's schema types model.*
    cfg = compose_experiment("tiny", ["model=gamma_tiny", "model.width=32"])
    assert (cfg.model.name, cfg.model.width) == ("gamma", 32)
    assert cfg.model._metadata.object_type.__name__ == "GammaConfig"
    with pytest.raises(ConfigError) as exc:
        compose_experiment("tiny", ["model=gamma_tiny", "model.widht=32"])
    assert "model.widht" in str(exc.value)


def test_family_path_is_read_each_call(fake, family_path, monkeypatch):
    assert "gamma" in list_families("fake")
    monkeypatch.setenv(FAMILY_PATH_ENV, "")
    assert "gamma" not in list_families("fake")


def test_a_family_without_a_tiny_flavor_is_refused():
    with pytest.raises(ValueError, match="tiny"):
        Family(name="x", stack="fake", schema=object, flavors={"big": 1})


def test_families_of_another_stack_are_left_out_silently_and_imported_once(
    fake, family_path, tmp_path, monkeypatch
):
    # An entry point and a family-path folder whose families belong to another stack: each
    # module records every time it runs.
    site = tmp_path / "other_site"
    record = "with Path(__file__).with_suffix('.runs').open('a') as f:\n    f.write('x')\n"
    tag = uuid.uuid4().hex[:8]
    other = f"other_family_{tag}"
    text = FAMILY_MODULE.format(cls="OtherConfig", name="other", stack="other", ckpt="o")
    _write(site / f"{other}.py", "from pathlib import Path\n" + record + text)
    dist = site / f"{other}-0.1.dist-info"
    _write(dist / "METADATA", f"Metadata-Version: 2.1\nName: {other}\nVersion: 0.1\n")
    _write(dist / "entry_points.txt", f"[longboat.families]\nother = {other}:FAMILY\n")
    monkeypatch.syspath_prepend(str(site))
    _write(family_path / "delta" / "__init__.py", "from pathlib import Path\n" + record)
    _write(
        family_path / "delta" / "config.py",
        FAMILY_MODULE.format(cls="DeltaConfig", name="delta", stack="other", ckpt="d"),
    )
    (family_path / "delta" / "__init__.py").write_text(
        (family_path / "delta" / "__init__.py").read_text() + "from .config import FAMILY\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            assert list_families("fake") == ["alpha", "beta", "gamma"]
            assert list_families("other") == ["delta", "other"]
    assert (site / f"{other}.runs").read_text() == "x"
    assert (family_path / "delta" / "__init__.runs").read_text() == "x"
