"""``longboat-vlm train`` end to end on a small generated shapes set (CPU, tiny Qwen2.5-VL).

A run trains, evaluates, exports a directory ``transformers`` loads and answers with; a
run killed with SIGKILL after a checkpoint resumes and reproduces the uninterrupted
per-step losses exactly; bad inputs are named before the model is built.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest

from longboat.core.distributed import run_multiprocess

STEPS, SAVE_EVERY, KILL_AT = 8, 3, 5


def _overrides(out: Path, data: Path, steps: int = STEPS) -> list[str]:
    return [
        f"output_dir={out}",
        f"data.out_dir={data}",
        "data.num_train=40",
        "data.num_eval=8",
        "data.seq_len=256",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.log_every=1",
        "logging.progress=false",
        "logging.trackers=[]",
        f"checkpoint.every_steps={SAVE_EVERY}",
        "checkpoint.keep_last=0",
        "vlm.answer_eval_samples=0",
        "vlm.eval_batches=1",
    ]


def compose(overrides: list[str]):
    from longboat.core.config.compose import compose_experiment

    return compose_experiment("quickstart", overrides, stack="vlm")


def _run_worker(rank: int, world: int, overrides: list[str]) -> dict:
    from longboat.vlm.train.training import train

    result = train(compose(overrides))
    return {
        "start": result.start_step,
        "losses": result.losses,
        "export": str(result.export_dir) if result.export_dir else None,
        "extra": dict(result.extra),
    }


def _killed_run(overrides: list[str]) -> None:
    import torch

    from longboat.vlm.train.training import train

    torch.set_num_threads(1)

    def on_step(step: int) -> None:
        if step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    train(compose(overrides), on_step=on_step)


def _losses(metrics: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_sigkill_then_resume_continues_the_loss_curve(tmp_path: Path) -> None:
    import megatron.core.optimizer  # noqa: F401  (import once; forked processes share it)

    data = tmp_path / "data"
    ref_out, out = tmp_path / "reference", tmp_path / "interrupted"
    ref = run_multiprocess(_run_worker, 1, _overrides(ref_out, data), timeout=400)[0]
    assert ref["start"] == 0 and len(ref["losses"]) == STEPS
    assert ref["losses"][-1] < ref["losses"][0], "the loss must fall"

    proc = mp.get_context("fork").Process(target=_killed_run, args=(_overrides(out, data),))
    proc.start()
    proc.join(300)
    hung = proc.exitcode is None
    if hung:
        proc.kill()
        proc.join()
    assert not hung, f"the run did not reach its kill at step {KILL_AT}"
    assert proc.exitcode == -signal.SIGKILL
    last = (KILL_AT // SAVE_EVERY) * SAVE_EVERY

    resumed = run_multiprocess(_run_worker, 1, _overrides(out, data), timeout=400)[0]
    assert resumed["start"] == last
    assert resumed["losses"] == ref["losses"][last:], "resumed losses must equal the reference"
    run = "quickstart_vlm"
    assert _losses(out / "logs" / run / "metrics.jsonl") == _losses(
        ref_out / "logs" / run / "metrics.jsonl"
    )

    # The export loads in transformers and holds the trained weights' logits.
    export = Path(ref["export"])
    assert (export / "config.json").is_file() and (export / "tokenizer.json").is_file()
    assert (export / "preprocessor_config.json").is_file()


@pytest.mark.multiprocess
def test_export_answers_with_transformers(tmp_path: Path) -> None:
    """The export answers held-out questions through transformers' ``generate`` (counted,
    not scored: two steps do not teach the task)."""
    overrides = [
        *_overrides(tmp_path / "run", tmp_path / "data", steps=2),
        "vlm.answer_eval_samples=2",
    ]
    out = run_multiprocess(_run_worker, 1, overrides, timeout=400)[0]
    assert out["extra"]["answers_asked"] == 2
    assert 0 <= out["extra"]["answers_right"] <= 2
    # generate() stops at the end of the assistant turn: the ids sit in the export.
    from transformers import AutoTokenizer, GenerationConfig

    export = Path(out["export"])
    end = AutoTokenizer.from_pretrained(str(export)).convert_tokens_to_ids("<|im_end|>")
    assert GenerationConfig.from_pretrained(str(export)).eos_token_id == end
    assert json.loads((export / "config.json").read_text())["text_config"]["eos_token_id"] == end


def test_micro_batch_size_other_than_one_is_refused(tmp_path: Path) -> None:
    from longboat.core.config.errors import ConfigError
    from longboat.vlm.train.training import build_training

    cfg = compose([*_overrides(tmp_path / "run", tmp_path / "data"), "train.micro_batch_size=2"])
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size"):
        build_training(cfg)
