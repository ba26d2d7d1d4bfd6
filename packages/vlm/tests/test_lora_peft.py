"""A VLM LoRA run writes its adapters as a PEFT adapter (CPU, tiny checkpoints, fp32).

``longboat-vlm train ... lora.enabled=true`` (two steps) writes ``hf_adapter/`` beside the
merged ``hf/`` export, for each family (Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision):
``peft.PeftModel.from_pretrained`` puts it on the source checkpoint with no missing or
unexpected keys and gives the merged export's logits within 1e-4 on a prompt with an image.
Components that trained in full go in the adapter as PEFT's ``modules_to_save``: the patch
merger with ``model.freeze=[vision]`` (Qwen3-VL: and each deepstack merger), the whole tower
with nothing frozen (LLaVA-OneVision: with the projector frozen), none with both frozen.
``export.adapter_dir`` without LoRA, or where the trained projector holds a parameter PEFT
cannot carry (LLaVA-OneVision's ``image_newline``), is refused before anything is built.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from vlm_testkit import HF_CLASSES, make_vlm_checkpoint, packed_image_row, run_cli_commands

TOLERANCE = 1e-4
"""Max |dlogit| between the PEFT adapter on the source and the merged export (fp32: the
merge and PEFT's forward add the same low-rank product in another order)."""


def _family(name: str) -> Any:
    return importlib.import_module(f"longboat.vlm.models.{name}.model")


def _qwen_probe(cfg: Any) -> dict[str, Any]:
    from longboat.vlm.models.mrope import token_types

    row = packed_image_row(cfg, 3, [[1, 8, 8]])
    inputs = {k: row[k] for k in ("input_ids", "pixel_values", "image_grid_thw")}
    ids = inputs["input_ids"]
    inputs["mm_token_type_ids"] = token_types(ids, cfg.image_token_id, cfg.video_token_id).int()
    return inputs


def _llava_probe(cfg: Any) -> dict[str, Any]:
    """One tiled image through transformers' own image processor, between random tokens."""
    import numpy as np
    from PIL import Image
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from longboat.vlm.data.llava_processor import LlavaProcessorConfig, LlavaVisionProcessor

    h, w, size = 20, 37, cfg.vision.image_size
    pixels = np.random.default_rng(3).integers(0, 256, (h, w, 3), dtype=np.uint8)
    hf = LlavaOnevisionImageProcessorPil(
        size={"height": size, "width": size},
        image_grid_pinpoints=[list(p) for p in cfg.image_grid_pinpoints],
    )([[Image.fromarray(pixels)]], return_tensors="pt")
    ours = LlavaVisionProcessor(
        LlavaProcessorConfig(crop_size=size, patch_size=cfg.vision.patch_size,
                             image_grid_pinpoints=cfg.image_grid_pinpoints,
                             vision_aspect_ratio=cfg.vision_aspect_ratio)
    )  # fmt: skip
    n = ours.grid_tokens(ours.image_grid(h, w, alone=True))
    g = torch.Generator().manual_seed(3)
    text = torch.randint(0, 300, (10,), generator=g).tolist()
    ids = torch.tensor([text[:4] + [cfg.image_token_id] * n + text[4:]])
    return {"input_ids": ids, "pixel_values": hf["pixel_values"],
            "image_sizes": hf["image_sizes"], "batch_num_images": hf["batch_num_images"]}  # fmt: skip


def _probe(family: str, ckpt: Path) -> dict[str, Any]:
    cfg = _family(family).read_hf_config(ckpt)
    return _llava_probe(cfg) if family == "llava_onevision" else _qwen_probe(cfg)


def _logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


SAVED = {
    ("qwen2_5_vl", "[vision]"): ["model.visual.merger"],
    ("qwen2_5_vl", "[]"): ["model.visual"],
    ("qwen2_5_vl", "[vision,projector]"): None,
    ("qwen3_vl", "[vision]"): ["model.visual.deepstack_merger_list.0",
                               "model.visual.deepstack_merger_list.1", "model.visual.merger"],
    ("llava_onevision", "[projector]"): ["model.vision_tower"],
}  # fmt: skip
"""``(family, model.freeze)`` -> the adapter's ``modules_to_save``."""


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two LoRA steps of each ``SAVED`` case through ``longboat-vlm train``, every run in one
    fresh process (its imports paid once)."""
    from longboat.vlm.data.shapes_dataset import make_shapes_dataset

    runs, commands = {}, []
    for family, freeze in sorted(SAVED):
        tmp = tmp_path_factory.mktemp("vlm_lora_peft")
        ckpt = make_vlm_checkpoint(tmp / "ckpt", family)
        shapes = make_shapes_dataset(tmp / "shapes", 8, seed=0, size=64)
        run = tmp / "run"
        commands.append(["train", "experiment=sft", f"model.init_from={ckpt}",
                         f"data.paths=[{shapes.train}]", f"data.root={shapes.train.parent}",
                         "lora.enabled=true", "lora.rank=4", "lora.alpha=8",
                         f"model.freeze={freeze}", "optim.lr=3e-3",
                         "optim.schedule.warmup_steps=0", "train.precision=fp32",
                         f"output_dir={run}", "train.steps=2", "train.global_batch_size=2",
                         "data.seq_len=512", "logging.progress=false",
                         "logging.trackers=[]"])  # fmt: skip
        runs[(family, freeze)] = {"ckpt": ckpt, "export": run / "hf",
                                  "adapter": run / "hf_adapter", "family": family,
                                  "saved": SAVED[(family, freeze)]}  # fmt: skip
    for stdout, run in zip(run_cli_commands(commands), runs.values(), strict=True):
        assert f"PEFT adapter: {run['adapter']}" in stdout, stdout[-3000:]
    return runs


@pytest.fixture(params=sorted(SAVED), ids=lambda case: "-".join(case))
def lora_run(request: pytest.FixtureRequest, lora_runs: dict) -> dict:
    return lora_runs[request.param]


def test_the_adapter_on_the_source_gives_the_merged_exports_logits(lora_run: dict) -> None:
    import transformers
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    ckpt, adapter, family = lora_run["ckpt"], lora_run["adapter"], lora_run["family"]
    hf_class = getattr(transformers, HF_CLASSES[family])
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(ckpt)
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    saved = lora_run["saved"]
    assert config["modules_to_save"] == saved
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    layers = _family(family).read_hf_config(ckpt).language.num_layers
    lora_keys = [k for k in tensors if ".lora_" in k]
    # 7 HF projections (q, k, v, o, gate, up, down) per layer, an A and a B each.
    assert len(lora_keys) == layers * 7 * 2
    assert all(k.startswith("base_model.model.model.language_model.layers.") for k in lora_keys)

    inputs = _probe(family, ckpt)
    source = hf_class.from_pretrained(str(ckpt)).eval()
    whole = {k for k in tensors if ".lora_" not in k}
    if saved is None:
        assert not whole
    else:
        prefixes = tuple(f"{name}." for name in saved)
        assert whole and all(
            k.removeprefix("base_model.model.").startswith(prefixes) for k in whole
        )
        n_source = sum(k.startswith(prefixes) for k in source.state_dict())
        assert len(whole) == n_source, "every tensor of the modules, as the source has them"
    base = _logits(source, inputs)
    peft_model = PeftModel.from_pretrained(source, str(adapter)).eval()
    assert set(get_peft_model_state_dict(peft_model)) == set(tensors), "missing/unexpected keys"
    again = peft_model.load_adapter(str(adapter), adapter_name="again")
    assert not again.missing_keys and not again.unexpected_keys
    peft_model.delete_adapter("again")
    peft_model.set_adapter("default")
    wrapped = sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    assert wrapped == layers * 7, "the adapter must touch only the decoder's projections"
    got = _logits(peft_model, inputs)
    merged = hf_class.from_pretrained(str(lora_run["export"])).eval()
    want = _logits(merged, inputs)
    assert (want - base).abs().max().item() > 1e-3, "two steps must move the model"
    diff = (got - want).abs().max().item()
    assert diff < TOLERANCE, f"PEFT adapter vs merged export: max |dlogit| {diff:.2e}"


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The command line's output of ``argv``, which must exit 2 before any work (in this
    process: a refusal builds nothing and starts no thread)."""
    from longboat.vlm.cli import main

    code = main(argv)
    text = capsys.readouterr()
    assert code == 2, text.out[-2000:] + text.err[-2000:]
    return text.out + text.err


def test_the_adapter_dir_without_lora_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _refused(["train", "experiment=quickstart", f"output_dir={tmp_path / 'run'}",
                    f"export.adapter_dir={tmp_path / 'adapter'}"], capsys)  # fmt: skip
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
                     "~model.lr_scale", f"parallel.tensor_parallel={tp}"]  # fmt: skip
        run_multiprocess(_adapter_run, tp, overrides, timeout=600)
        outs[tp] = load_file(str(adapter / "adapter_model.safetensors"))
    assert sorted(outs[1]) == sorted(outs[2])
    assert any(k.endswith("lora_B.weight") and outs[1][k].abs().max() > 0 for k in outs[1])
    for key, want in outs[1].items():
        diff = (outs[2][key] - want).abs().max().item()
        assert diff < 1e-5, f"{key}: TP=2 vs TP=1 max |d| {diff:.2e}"


def test_a_trained_part_peft_cannot_carry_refuses_the_adapter_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LLaVA-OneVision's projector trains with ``model.image_newline``, a bare parameter that
    PEFT's ``modules_to_save`` cannot hold: refused before the run, naming the fix."""
    out = _refused(["train", "experiment=quickstart", "model=llava_onevision_tiny",
                    "lora.enabled=true", "model.freeze=[vision]", "~model.lr_scale",
                    f"output_dir={tmp_path / 'run'}",
                    f"export.adapter_dir={tmp_path / 'adapter'}"], capsys)  # fmt: skip
    assert "export.adapter_dir" in out and "llava_onevision family trains the projector" in out
    assert "model.image_newline" in out and "add projector to model.freeze" in out
    assert not (tmp_path / "run" / "hf").exists()


def test_which_families_and_freezes_can_write_an_adapter() -> None:
    from types import SimpleNamespace

    from longboat.vlm.train.lora import adapter_export_problem

    why, fix = adapter_export_problem(SimpleNamespace())
    assert "has no PEFT adapter layout" in why and fix == ""
    llava = _family("llava_onevision")
    assert adapter_export_problem(llava, ["projector"]) is None
    assert adapter_export_problem(llava, ["vision", "projector"]) is None
    why, fix = adapter_export_problem(llava, [])
    assert "image_newline" in why and fix == "add projector to model.freeze, or "
    for family in ("qwen2_5_vl", "qwen3_vl"):
        for frozen in ([], ["vision"], ["projector"], ["vision", "projector"]):
            assert adapter_export_problem(_family(family), frozen) is None
