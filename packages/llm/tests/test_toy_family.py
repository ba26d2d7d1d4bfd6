"""A family added from a folder outside the package (``tests/toy_family``: its folder and one
model YAML, found through ``LONGBOAT_FAMILY_PATH``) is listed, composes and trains two steps
through ``longboat-llm train`` in a forked process, with nothing of the llm stack edited."""

from __future__ import annotations

import json
import math
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
    assert list_families("llm") == ["deepseek_v3", "llama3", "qwen3", "qwen3_moe", "toy_llm"]
    family = find_family("llm", "toy_llm")
    assert family.stack == "llm" and family.flavor("tiny").qk_norm
    assert family.flops_per_sample(family.flavor("tiny"), 64) > 0


def _train(rank: int, world: int, argv: list[str]) -> tuple[int, object]:
    """``longboat-llm train`` in this process; its exit code and what the toy built."""
    from longboat.llm.cli import main

    code = main(argv)
    toy = next(m for n, m in sys.modules.items() if n.startswith("longboat_family_path.toy_llm"))
    return code, bool(toy.SPEC_CALLS)


def test_the_toy_family_trains_two_steps_through_the_cli(
    toy_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [
        "model=toy_llm_tiny",
        f"output_dir={tmp_path}",
        "data.seq_len=32",
        "parallel.tensor_parallel=1",
        "parallel.pipeline_parallel=1",
        "train.steps=2",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "train.eval_every=0",
        "train.log_every=1",
        "checkpoint.every_steps=0",
        "logging.progress=false",
        "logging.trackers=[]",
        "export.enabled=false",
        "llm.generate_prompt=null",
    ]
    # a forked process: a run in the test process would leave its threads and locks to the
    # forked workers of later tests
    code, probe = run_multiprocess(_train, 1, ["train", "qwen3_tiny", *overrides], timeout=600)[0]
    assert code == 0, capsys.readouterr()
    assert probe, "the run did not build the toy family's layer spec"
    metrics = next(tmp_path.rglob("metrics.jsonl")).read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in metrics if '"loss"' in line]
    # two steps from a random init over the toy's 128-token vocabulary: about ln(128)
    assert len(losses) == 2 and all(abs(loss - math.log(128)) < 0.5 for loss in losses), losses
    manifest = json.loads(next((tmp_path / "checkpoints").rglob("manifest.json")).read_text())
    assert manifest["config"]["model"]["name"] == "toy_llm"


def test_listing_and_finding_families_imports_no_torch(toy_path: Path) -> None:
    code = (
        "import sys\n"
        "from longboat.core.family import find_family, list_families\n"
        "names = list_families('llm')\n"
        "[find_family('llm', n).flavors for n in names]\n"
        "print(len(names), 'torch' in sys.modules, 'megatron.core' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, torch_loaded, megatron_loaded = out.stdout.split()
    assert (
        int(count) == EXPECTED_COUNT and torch_loaded == "False" and megatron_loaded == "False"
    ), out


def test_every_llm_family_implements_the_contract() -> None:
    from longboat.core.family import StateDictAdapter
    from longboat.core.megatron.decoder_config import DecoderModelConfig

    for name in list_families("llm"):
        family = find_family("llm", name)
        tiny = family.flavor("tiny")
        assert (family.stack, tiny.name) == ("llm", name)
        assert issubclass(family.model_schema(), DecoderModelConfig)  # the base or its extension
        assert isinstance(family.adapter, StateDictAdapter) and family.adapter.format == "hf"
        # 6 N per token plus attention: more than 6 N x tokens, less than twice that here
        n = family.flops_per_sample(tiny, 1) / 6
        assert n > 0 and family.flops_per_sample(tiny, 64) > 64 * 6 * n
