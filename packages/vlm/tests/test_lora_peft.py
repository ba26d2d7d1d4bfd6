"""A VLM LoRA run writes its adapters as a PEFT adapter (CPU, tiny Qwen2.5-VL, fp32).

``longboat-vlm train ... lora.enabled=true`` (two steps) writes ``hf_adapter/`` beside the
merged ``hf/`` export: ``peft.PeftModel.from_pretrained`` puts it on the source checkpoint
and gives the merged export's logits within 1e-4 on a prompt with an image. Components that
trained in full go in the adapter as PEFT's ``modules_to_save``: the patch merger with
``model.freeze=[vision]``, the whole tower with nothing frozen, none with both frozen.
``export.adapter_dir`` without LoRA is refused before anything is built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from vlm_testkit import make_qwen2_5_vl_checkpoint, packed_image_row

TOLERANCE = 1e-4
"""Max |dlogit| between the PEFT adapter on the source and the merged export (fp32: the
merge and PEFT's forward add the same low-rank product in another order)."""


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LONGBOAT_ACCELERATOR": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "longboat.vlm.cli", *argv], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def _probe(ckpt: Path) -> dict[str, Any]:
    from longboat.vlm.models.mrope import token_types
    from longboat.vlm.models.qwen2_5_vl.model import read_hf_config

    cfg = read_hf_config(ckpt)
    row = packed_image_row(cfg, 3, [[1, 8, 8]])
    inputs = {k: row[k] for k in ("input_ids", "pixel_values", "image_grid_thw")}
    ids = inputs["input_ids"]
    inputs["mm_token_type_ids"] = token_types(ids, cfg.image_token_id, cfg.video_token_id).int()
    return inputs


def _logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


SAVED = {"[vision]": ["model.visual.merger"], "[]": ["model.visual"], "[vision,projector]": None}
"""``model.freeze`` -> the adapter's ``modules_to_save``."""


@pytest.fixture(scope="module", params=sorted(SAVED))
def lora_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from longboat.vlm.data.shapes_dataset import make_shapes_dataset

    tmp = tmp_path_factory.mktemp("vlm_lora_peft")
    ckpt = make_qwen2_5_vl_checkpoint(tmp / "ckpt")
    shapes = make_shapes_dataset(tmp / "shapes", 8, seed=0, size=64)
    run = tmp / "run"
    argv = ["train", "experiment=sft", f"model.init_from={ckpt}",
            f"data.paths=[{shapes.train}]", f"data.root={shapes.train.parent}",
            "lora.enabled=true", "lora.rank=4", "lora.alpha=8", f"model.freeze={request.param}",
            "optim.lr=3e-3", "optim.schedule.warmup_steps=0", "train.precision=fp32",
            f"output_dir={run}", "train.steps=2", "train.global_batch_size=2",
            "data.seq_len=512", "logging.progress=false", "logging.trackers=[]"]  # fmt: skip
    done = _cli(argv, tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"PEFT adapter: {run / 'hf_adapter'}" in done.stdout + done.stderr
    return {"ckpt": ckpt, "export": run / "hf", "adapter": run / "hf_adapter",
            "freeze": request.param}  # fmt: skip


def test_the_adapter_on_the_source_gives_the_merged_exports_logits(lora_run: dict) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    ckpt, adapter = lora_run["ckpt"], lora_run["adapter"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(ckpt)
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    saved = SAVED[lora_run["freeze"]]
    assert config["modules_to_save"] == saved
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    from longboat.vlm.models.qwen2_5_vl.model import read_hf_config

    layers = read_hf_config(ckpt).language.num_layers
    lora_keys = [k for k in tensors if ".lora_" in k]
    # 7 HF projections (q, k, v, o, gate, up, down) per layer, an A and a B each.
    assert len(lora_keys) == layers * 7 * 2
    assert all(k.startswith("base_model.model.model.language_model.layers.") for k in lora_keys)
    whole = {k for k in tensors if ".lora_" not in k}
    if saved is None:
        assert not whole
    else:
        assert whole and all(k.startswith(f"base_model.model.{saved[0]}.") for k in whole)
        source_keys = load_file(str(ckpt / "model.safetensors"))
        n_visual = sum(k.startswith(saved[0].removeprefix("model.") + ".") for k in source_keys)
        assert len(whole) == n_visual, "every tensor of the module, as the source has it"

    inputs = _probe(ckpt)
    source = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(ckpt)).eval()
    base = _logits(source, inputs)
    peft_model = PeftModel.from_pretrained(source, str(adapter)).eval()
    wrapped = sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    assert wrapped == layers * 7, "the adapter must touch only the decoder's projections"
    got = _logits(peft_model, inputs)
    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(lora_run["export"])).eval()
    want = _logits(merged, inputs)
    assert (want - base).abs().max().item() > 1e-3, "two steps must move the model"
    diff = (got - want).abs().max().item()
    assert diff < TOLERANCE, f"PEFT adapter vs merged export: max |dlogit| {diff:.2e}"


def test_the_adapter_dir_without_lora_is_refused(tmp_path: Path) -> None:
    done = _cli(["train", "experiment=quickstart", f"output_dir={tmp_path / 'run'}",
                 f"export.adapter_dir={tmp_path / 'adapter'}"], tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout + done.stderr
    assert "export.adapter_dir" in out and "lora.enabled=false" in out
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "run" / "hf").exists()


def _adapter_run(rank: int, world: int, overrides: list[str]) -> str:
    from longboat.core.config.compose import compose_experiment
    from longboat.vlm.train.training import train

    train(compose_experiment("quickstart", overrides, stack="vlm"))
    return overrides[0]


@pytest.mark.multiprocess
def test_tp2_writes_the_tp1_adapter(tmp_path: Path) -> None:
    """The adapter gathered from two tensor-parallel ranks (column- and row-parallel
    adapters, the merger's shards) is the TP=1 run's within 1e-5."""
    from safetensors.torch import load_file

    from longboat.core.distributed import run_multiprocess

    data = tmp_path / "data"
    outs = {}
    for tp in (1, 2):
        adapter = tmp_path / f"adapter_tp{tp}"
        overrides = [f"export.adapter_dir={adapter}", f"output_dir={tmp_path / f'run{tp}'}",
                     f"data.out_dir={data}", "data.num_train=8", "data.num_eval=2",
                     "data.seq_len=256", "train.steps=2", "train.global_batch_size=2",
                     "train.eval_every=0", "logging.progress=false",
                     "logging.trackers=[]", "vlm.answer_eval_samples=0",
                     "lora.enabled=true", "lora.rank=4", "model.freeze=[vision]",
                     f"parallel.tensor_parallel={tp}"]  # fmt: skip
        run_multiprocess(_adapter_run, tp, overrides, timeout=600)
        outs[tp] = load_file(str(adapter / "adapter_model.safetensors"))
    assert sorted(outs[1]) == sorted(outs[2])
    assert any(k.endswith("lora_B.weight") and outs[1][k].abs().max() > 0 for k in outs[1])
    for key, want in outs[1].items():
        diff = (outs[2][key] - want).abs().max().item()
        assert diff < 1e-5, f"{key}: TP=2 vs TP=1 max |d| {diff:.2e}"


def test_a_family_without_a_peft_layout_refuses_the_adapter_dir(tmp_path: Path) -> None:
    done = _cli(["train", "experiment=quickstart", "model=qwen3_vl_tiny", "lora.enabled=true",
                 f"output_dir={tmp_path / 'run'}", f"export.adapter_dir={tmp_path / 'adapter'}"],
                tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout + done.stderr
    assert "export.adapter_dir" in out and "qwen3_vl family has no PEFT adapter layout" in out
    assert not (tmp_path / "run" / "hf").exists()
