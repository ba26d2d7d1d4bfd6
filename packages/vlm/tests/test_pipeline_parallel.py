"""``longboat-vlm train`` with the decoder split over two pipeline stages (CPU, gloo, tiny).

From the same HF weights, a 2-step run at ``parallel.pipeline_parallel=2`` (three
microbatches a step through megatron's 1F1B schedule, evals, a checkpoint after step 1 that
a second launch resumes from) logs the PP=1 run's losses and eval losses within 1e-5, and
its Hugging Face export (one shard per stage plus an index) loads in ``transformers`` with
the PP=1 export's weights within 1e-5. Settings the pipeline cannot run with stop the run
before the data and the model are built, naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess

TOL = 1e-5


def _overrides(out: Path, data: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={out}",
        f"data.out_dir={data}",
        "data.num_train=24",
        "data.num_eval=4",
        "data.seq_len=256",
        "train.steps=2",
        "train.global_batch_size=3",
        "train.eval_every=1",
        "train.log_every=1",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=0",
        "vlm.answer_eval_samples=0",
        "vlm.eval_batches=2",
        *extra,
    ]


def _compose(overrides: list[str]):
    from longboat.core.config.compose import compose_experiment

    return compose_experiment("quickstart", overrides, stack="vlm")


def _run_worker(rank: int, world: int, overrides: list[str]) -> dict:
    from longboat.vlm.train.training import train

    result = train(_compose(overrides))
    return {"start": result.start_step, "losses": result.losses, "export": str(result.export_dir)}


def _metrics(out: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in next(out.rglob("metrics.jsonl")).read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def _initial_hf(tmp_path: Path, data: Path) -> Path:
    """Random HF weights of the run's model (its tokenizer's token ids), for both runs: a
    from-scratch init draws the layers of each stage from a different random stream."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from longboat.core.train import typed_config
    from longboat.vlm.models.qwen2_5_vl.model import to_hf_config
    from longboat.vlm.train.data import open_run_data
    from longboat.vlm.train.training import model_config

    cfg = typed_config(_compose(_overrides(tmp_path / "unused", data)))
    model_cfg = open_run_data(cfg, model_config(cfg)).model_cfg
    torch.manual_seed(0)
    out = tmp_path / "init_hf"
    Qwen2_5_VLForConditionalGeneration(to_hf_config(model_cfg)).save_pretrained(out)
    return out


@pytest.mark.multiprocess
def test_pipeline_parallel_run_equals_single(tmp_path: Path) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    data = tmp_path / "data"
    init = f"model.init_from={_initial_hf(tmp_path, data)}"
    ref_out, pp_out = tmp_path / "pp1", tmp_path / "pp2"
    (ref,) = run_multiprocess(_run_worker, 1, _overrides(ref_out, data, init), timeout=400)
    pp2 = _overrides(pp_out, data, init, "parallel.pipeline_parallel=2")
    run_multiprocess(_run_worker, 2, [*pp2, "train.steps=1"], timeout=400)
    outs = run_multiprocess(_run_worker, 2, pp2, timeout=400)  # resumes after step 1
    want, got = _metrics(ref_out, "loss"), _metrics(pp_out, "loss")
    assert sorted(want) == sorted(got) == [1, 2]
    for step, loss in want.items():
        assert abs(got[step] - loss) < TOL * max(1.0, loss), (got, want)
    for out in outs:  # every rank reports the last stage's loss
        assert out["start"] == 1
        assert out["losses"] == pytest.approx(ref["losses"][1:], rel=TOL, abs=TOL)
    eval_want, eval_got = _metrics(ref_out, "eval_loss"), _metrics(pp_out, "eval_loss")
    assert eval_want and eval_want.keys() == eval_got.keys()
    for step, loss in eval_want.items():
        assert abs(eval_got[step] - loss) < TOL * max(1.0, loss), (eval_got, eval_want)

    export = Path(outs[0]["export"])
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2, "one shard per pipeline stage"
    a = Qwen2_5_VLForConditionalGeneration.from_pretrained(ref["export"]).state_dict()
    b = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(export)).state_dict()
    assert a.keys() == b.keys()
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert diff < TOL, f"the PP=2 export differs from the PP=1 export by {diff:.2e}"
    print(f"PP=2 run vs PP=1: losses {got} vs {want}; export within {diff:.1e}")


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["parallel.pipeline_parallel=3"], "parallel.pipeline_parallel"),
        (
            ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline_parallel=2"],
            "parallel.virtual_pipeline_parallel",
        ),
        (["parallel.pipeline_parallel=2", "model.freeze=[language]"], "model.freeze"),
        (
            ["model=llava_onevision_tiny", "parallel.pipeline_parallel=2"],
            "does not support pipeline parallelism",
        ),
    ],
)
def test_pipeline_settings_the_model_cannot_run_are_named(
    extra: list[str], key: str, tmp_path: Path
) -> None:
    from longboat.vlm.train.training import build_training

    with pytest.raises(ConfigError) as err:
        build_training(_compose(_overrides(tmp_path / "out", tmp_path / "data", *extra)))
    assert key in str(err.value)
    assert not (tmp_path / "data").exists(), "refused before the data was prepared"
