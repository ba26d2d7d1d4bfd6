"""A family added from a folder outside the package (``tests/toy_family``: its folder and one
model YAML, found through ``LONGBOAT_FAMILY_PATH``) is listed, composes and trains two steps
through ``longboat-diffusion train`` in this process, with nothing of the diffusion stack
edited."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from longboat.core.distributed import run_multiprocess
from longboat.core.family import FAMILY_PATH_ENV, find_family, list_families

TOY = Path(__file__).with_name("toy_family")
EXPECTED_COUNT = 3  # the stack's families and the toy


@pytest.fixture
def toy_path(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(FAMILY_PATH_ENV, str(TOY))
    return TOY


def test_the_toy_family_is_found_by_its_folder(toy_path: Path) -> None:
    assert list_families("diffusion") == ["flux", "toy_dit", "wan"]
    family = find_family("diffusion", "toy_dit")
    assert family.stack == "diffusion" and family.diffusers_classes == ("ToyDiT",)
    assert family.flavor("tiny").num_layers == 1


def _train(rank: int, world: int, argv: list[str]) -> tuple[int, object]:
    """``longboat-diffusion train`` in this process; its exit code and what the toy built."""
    from longboat.diffusion.cli import main

    code = main(argv)
    toy = next(m for n, m in sys.modules.items() if n.startswith("longboat_family_path.toy_dit"))
    return code, [cfg.num_layers for cfg in toy.BUILT]


def test_the_toy_family_trains_two_steps_through_the_cli(
    toy_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [
        "model=toy_dit_tiny",
        f"output_dir={tmp_path}",
        f"data.out_dir={tmp_path / 'data'}",
        "data.num_samples=8",
        "data.num_eval_samples=4",
        "data.shapes=[[1,4,4]]",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "train.steps=2",
        "train.eval_every=0",
        "train.log_every=1",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.every_steps=0",
        "diffusion.preview_captions=0",
    ]
    # a forked process: a run in the test process would leave its threads and locks to the
    # forked workers of later tests
    code, probe = run_multiprocess(_train, 1, ["train", "quickstart", *overrides], timeout=600)[0]
    assert code == 0, capsys.readouterr()
    assert probe == [1], probe
    metrics = next(tmp_path.rglob("metrics.jsonl")).read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in metrics if '"loss"' in line]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses), losses
    manifest = json.loads(next((tmp_path / "checkpoints").rglob("manifest.json")).read_text())
    assert manifest["config"]["model"]["name"] == "toy_dit"


def test_listing_and_finding_families_imports_no_torch(toy_path: Path) -> None:
    code = (
        "import sys\n"
        "from longboat.core.family import find_family, list_families\n"
        "names = list_families('diffusion')\n"
        "[find_family('diffusion', n).flavors for n in names]\n"
        "print(len(names), 'torch' in sys.modules, 'megatron.core' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, torch_loaded, megatron_loaded = out.stdout.split()
    assert (
        int(count) == EXPECTED_COUNT and torch_loaded == "False" and megatron_loaded == "False"
    ), out


def test_every_diffusion_family_implements_the_contract() -> None:
    from longboat.core.family import StateDictAdapter
    from longboat.diffusion.train.schema import DiffusionModelConfig

    for name in list_families("diffusion"):
        family = find_family("diffusion", name)
        assert family.stack == "diffusion" and "tiny" in family.flavors
        assert family.model_schema() is DiffusionModelConfig
        assert isinstance(family.adapter, StateDictAdapter)
        assert family.adapter.format == "diffusers"
    wan = find_family("diffusion", "wan")
    assert wan.flops_per_sample(wan.flavor("tiny"), 16, 8) > 0
