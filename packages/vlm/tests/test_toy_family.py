"""A family added from a folder outside the package (``tests/toy_family``: its folder and one
model YAML, found through ``LONGBOAT_FAMILY_PATH``) is listed, composes and trains two steps
through ``longboat-vlm train`` in this process, with nothing of the vlm stack edited."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from longboat.core.distributed import run_multiprocess
from longboat.core.family import FAMILY_PATH_ENV, find_family, list_families

TOY = Path(__file__).with_name("toy_family")
EXPECTED_COUNT = 5  # the stack's families and the toy


@pytest.fixture
def toy_path(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(FAMILY_PATH_ENV, str(TOY))
    return TOY


def test_the_toy_family_is_found_by_its_folder(toy_path: Path) -> None:
    assert list_families("vlm") == [
        "llava_onevision",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "toy_vlm",
    ]
    family = find_family("vlm", "toy_vlm")
    assert family.stack == "vlm" and list(family.flavors) == ["tiny"]
    assert family.flavor("tiny").language.num_layers == 2


def _train(rank: int, world: int, argv: list[str]) -> tuple[int, object]:
    """``longboat-vlm train`` in this process; its exit code and what the toy built."""
    from longboat.vlm.cli import main

    code = main(argv)
    toy = next(m for n, m in sys.modules.items() if n.startswith("longboat_family_path.toy_vlm"))
    return code, [cfg.language.num_layers for cfg in toy.model.BUILT]


def test_the_toy_family_trains_two_steps_through_the_cli(
    toy_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [
        "model=toy_vlm_tiny",
        f"output_dir={tmp_path}",
        f"data.out_dir={tmp_path / 'data'}",
        "data.num_train=8",
        "data.num_eval=2",
        "data.seq_len=256",
        "train.steps=2",
        "train.eval_every=0",
        "train.log_every=1",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.every_steps=0",
        "vlm.answer_eval_samples=0",
        "vlm.eval_batches=1",
    ]
    # a forked process: a run in the test process would leave its threads and locks to the
    # forked workers of later tests
    code, probe = run_multiprocess(_train, 1, ["train", "quickstart", *overrides], timeout=600)[0]
    assert code == 0, capsys.readouterr()
    assert probe == [2], probe
    metrics = next(tmp_path.rglob("metrics.jsonl")).read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in metrics if '"loss"' in line]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses), losses
    manifest = json.loads(next((tmp_path / "checkpoints").rglob("manifest.json")).read_text())
    assert manifest["config"]["model"]["name"] == "toy_vlm"


def test_listing_and_finding_families_imports_no_torch(toy_path: Path) -> None:
    code = (
        "import sys\n"
        "from longboat.core.family import find_family, list_families\n"
        "names = list_families('vlm')\n"
        "[find_family('vlm', n).flavors for n in names]\n"
        "print(len(names), 'torch' in sys.modules, 'megatron.core' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, torch_loaded, megatron_loaded = out.stdout.split()
    assert (
        int(count) == EXPECTED_COUNT and torch_loaded == "False" and megatron_loaded == "False"
    ), out


def test_every_vlm_family_implements_the_contract() -> None:
    from longboat.core.family import StateDictAdapter
    from longboat.vlm.train.schema import VLMModelConfig

    for name in list_families("vlm"):
        family = find_family("vlm", name)
        assert family.stack == "vlm" and "tiny" in family.flavors
        assert family.model_schema() is VLMModelConfig
        assert isinstance(family.adapter, StateDictAdapter) and family.adapter.format == "hf"
    qwen = find_family("vlm", "qwen2_5_vl")
    assert qwen.flops_per_sample(qwen.flavor("tiny"), 64, [[1, 4, 4]]) > 0
