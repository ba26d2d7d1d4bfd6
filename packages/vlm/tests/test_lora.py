"""LoRA on the language model of a VLM (CPU, gloo, tiny Qwen2.5-VL, fp32).

At init (B = 0) the adapted model's logits equal the base model's exactly; two steps with
the vision tower frozen move only the adapters and the projector (decoder base weights and
ViT blocks bit-identical); the HF export (adapters merged) reloaded by ``transformers`` gives
the adapted model's logits within 1e-4, and the model is unchanged by the export; TP=2
gives the TP=1 losses and logits within 1e-5; a LoRA run resumed from its checkpoint
reproduces the uninterrupted losses exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration
from vlm_testkit import packed_image_row

from longboat.core.distributed import run_multiprocess
from longboat.vlm.models.mrope import token_types
from longboat.vlm.models.qwen2_5_vl.model import flavor, to_hf_config

CFG = flavor("tiny")
V = CFG.vision
STEPS = 2


BATCH = [packed_image_row(CFG, 0, [[1, 4, 4], [1, 4, 8]]), packed_image_row(CFG, 1, [[1, 8, 4]])]
PROBE = packed_image_row(CFG, 2, [[1, 8, 8]])
"""One sample (no packing), for the logits compared with transformers."""


def _probe_inputs() -> dict[str, Any]:
    return {k: PROBE[k] for k in ("input_ids", "pixel_values", "image_grid_thw")}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(to_hf_config(CFG))
    out = tmp_path_factory.mktemp("vlm_lora")
    model.save_pretrained(out)
    return out


def _worker(rank: int, world: int, hf_dir: Path, tp: int, export: Path | None) -> dict[str, Any]:
    from longboat.core.config.schema import LoRAConfig, OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.hf_io import rank_coords, tp_shards
    from longboat.vlm.models.qwen2_5_vl.model import (
        build_qwen2_5_vl,
        load_hf,
        read_hf_config,
        save_hf,
    )
    from longboat.vlm.train.lora import merged_language
    from longboat.vlm.train.step import VLMTrainStep

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(tensor_parallel=tp), get_accelerator("cpu"))
    try:
        model = build_qwen2_5_vl(cfg)
        load_hf(model, cfg, hf_dir)
        coords = rank_coords()

        def logits() -> torch.Tensor:
            model.eval()
            with torch.no_grad():
                out = model(**_probe_inputs())
            model.train()
            return torch.cat(tp_shards(out, coords), dim=-1)

        base = logits()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        lora = LoRAConfig(enabled=True, rank=4, alpha=8.0)
        optim = OptimConfig(lr=3e-3, weight_decay=0.0, grad_clip=1.0)
        step = VLMTrainStep(model, optim, precision="fp32", frozen=("vision",), lora=lora, seed=7)
        at_init = logits()
        losses = []
        for _ in range(STEPS):
            losses.append(float(step.forward_backward(BATCH)))
            step.update()
        moved = {
            n: float((p.detach() - before[n]).abs().max()) if n in before else None
            for n, p in model.named_parameters()
        }
        trained = logits()
        if export is not None:
            with merged_language(model) as merged:
                save_hf(model, cfg, export)
        return {
            "base": base,
            "at_init": at_init,
            "trained": trained,
            "after_export": logits(),
            "losses": losses,
            "moved": moved,
            "adapters": step.lora_adapters,
            "merged": merged if export is not None else 0,
            "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        }
    finally:
        parallel_state.destroy()


@pytest.fixture(scope="module")
def tp1(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    export = tmp_path_factory.mktemp("vlm_lora_export") / "hf"
    (out,) = run_multiprocess(_worker, 1, hf_dir, 1, export, timeout=300)
    out["export"] = export
    return out


@pytest.mark.multiprocess
def test_lora_starts_at_the_base_model_and_trains_only_adapters(tp1: dict[str, Any]) -> None:
    assert torch.equal(tp1["at_init"], tp1["base"]), "B = 0: the adapters must change nothing"
    # 4 layers x (qkv, proj, fc1, fc2).
    assert tp1["adapters"] == 4 * CFG.language.num_layers
    moved = tp1["moved"]
    adapters = {n: v for n, v in moved.items() if v is None}
    assert len(adapters) == 2 * tp1["adapters"]  # lora_A + lora_B, new since the snapshot
    assert all(n.startswith("language.") and n.endswith(("lora_A", "lora_B")) for n in adapters)
    decoder = [v for n, v in moved.items() if n.startswith("language.") and v is not None]
    blocks = [v for n, v in moved.items() if n.startswith("vision.") and "merger" not in n]
    merger = [v for n, v in moved.items() if n.startswith("vision.merger")]
    assert decoder and max(decoder) == 0.0, "the decoder's base weights must not move"
    assert blocks and max(blocks) == 0.0, "model.freeze=[vision]: the ViT blocks must not move"
    assert max(merger) > 1e-4, "the projector trains"
    trainable = set(tp1["trainable"])
    assert {n for n in trainable if n.startswith("language.")} == set(adapters)
    diff = (tp1["trained"] - tp1["base"]).abs().max().item()
    assert diff > 1e-4, f"two steps must change the adapted model's logits (moved {diff:.1e})"
    assert tp1["losses"][1] < tp1["losses"][0]


@pytest.mark.multiprocess
def test_merged_export_gives_the_adapted_logits_in_transformers(tp1: dict[str, Any]) -> None:
    assert tp1["merged"] == tp1["adapters"]
    assert torch.equal(tp1["after_export"], tp1["trained"]), "the export must not change the model"
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tp1["export"]).eval()
    inputs = _probe_inputs()
    types = token_types(inputs["input_ids"], CFG.image_token_id, CFG.video_token_id).int()
    with torch.no_grad():
        got = hf(**inputs, mm_token_type_ids=types).logits
    diff = (got - tp1["trained"]).abs().max().item()
    assert diff < 1e-4, f"merged export vs adapted model: max |dlogit| {diff:.2e}"


@pytest.mark.multiprocess
def test_tp2_equals_tp1(hf_dir: Path, tp1: dict[str, Any]) -> None:
    outs = run_multiprocess(_worker, 2, hf_dir, 2, None, timeout=300)
    for out in outs:
        for a, b in zip(out["losses"], tp1["losses"], strict=True):
            assert abs(a - b) < 1e-5 * max(1.0, abs(b)), (out["losses"], tp1["losses"])
        diff = (out["trained"] - tp1["trained"]).abs().max().item()
        assert diff < 1e-5, f"TP=2 vs TP=1 logits after {STEPS} LoRA steps: {diff:.2e}"


RUN_STEPS, SAVE_EVERY, KILL_AT = 4, 2, 3


def _run_overrides(out: Path, data: Path) -> list[str]:
    return [
        f"output_dir={out}",
        f"data.out_dir={data}",
        "data.num_train=24",
        "data.num_eval=4",
        "data.seq_len=256",
        f"train.steps={RUN_STEPS}",
        "train.eval_every=0",
        "train.log_every=1",
        "logging.progress=false",
        "logging.trackers=[]",
        f"checkpoint.every_steps={SAVE_EVERY}",
        "checkpoint.keep_last=0",
        "vlm.answer_eval_samples=0",
        "lora.enabled=true",
        "lora.rank=4",
        "model.freeze=[vision]",
        "~model.lr_scale",  # the quickstart scales the frozen vision tower
    ]


def _train(overrides: list[str]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.vlm.train.training import train

    result = train(compose_experiment("quickstart", overrides, stack="vlm"))
    return {"start": result.start_step, "losses": result.losses, "export": result.export_dir}


def _run_worker(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    return _train(overrides)


_KILLED_RUN = """
import json, os, signal, sys
from longboat.core.config.compose import compose_experiment
from longboat.vlm.train.training import train

overrides, kill_at = json.loads(sys.argv[1]), int(sys.argv[2])

def on_step(step):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

train(compose_experiment("quickstart", overrides, stack="vlm"), on_step=on_step)
"""


def _killed_run(overrides: list[str]) -> int | None:
    """A run in a fresh interpreter, SIGKILLed at ``KILL_AT``; its return code (None: hung)."""
    import json
    import subprocess
    import sys

    args = [sys.executable, "-c", _KILLED_RUN, json.dumps(overrides), str(KILL_AT)]
    try:
        return subprocess.run(args, timeout=300, capture_output=True).returncode
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.multiprocess
def test_lora_run_resumes_exactly_and_exports_merged(tmp_path: Path) -> None:
    import signal

    from safetensors import safe_open

    data = tmp_path / "data"
    ref = run_multiprocess(_run_worker, 1, _run_overrides(tmp_path / "ref", data), timeout=400)[0]
    code = _killed_run(_run_overrides(tmp_path / "cut", data))
    assert code == -signal.SIGKILL, f"the run did not reach its kill (exit code {code})"
    resumed = run_multiprocess(_run_worker, 1, _run_overrides(tmp_path / "cut", data))[0]
    last = (KILL_AT // SAVE_EVERY) * SAVE_EVERY
    assert resumed["start"] == last
    assert resumed["losses"] == ref["losses"][last:], "resumed LoRA losses must equal the run's"
    with safe_open(str(Path(ref["export"]) / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and not [n for n in names if "lora" in n], "the export holds merged weights"
