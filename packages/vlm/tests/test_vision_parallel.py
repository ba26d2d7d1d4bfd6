"""An unsharded vision tower under a tensor-parallel decoder (``model.vision_tensor_parallel=1``,
CPU, gloo, tiny models): the TP ranks encode different images and exchange the embeddings.

From the same HF weights, LLM TP=2 with ViT TP=1 trains as the single process does (three
steps of microbatches with images, one with a single image, so a TP rank encodes none, and a
video): losses, grad norms (clipping on), every parameter's gradient after the first
backward and every weight after the last step within 1e-5; so does TP=2 x DP=2 (world 4).
The export reloads in ``transformers`` with the single process's logits. Qwen3-VL (a tower
with deepstack features) gives the TP=1 logits, loss, tower gradients and grad norm at world
2, and its export gives back the checkpoint's tensors. ``longboat-vlm train`` with the key
takes the plain TP=2 run's steps and names the layout. The image deal is deterministic and
balanced; unsupported sizes, pipeline parallelism and the LLaVA-OneVision family are refused
naming the key before anything is built.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

from longboat.core.distributed import run_multiprocess
from longboat.vlm.models.vision_parallel import (
    assign_images,
    image_costs,
    resolve_vision_tensor_parallel,
)

TOL = 1e-5
LR = 5e-4
"""Adam turns the rounding noise of near-zero gradients (the key biases', whose true
gradient is zero) into steps of up to ``lr``: at 3e-3 the weights of plain TP=2 (and of ViT
TP=1) drift 3e-5 (2e-5) from TP=1's in three steps while the gradients agree within 4e-8."""


def _family(name: str) -> Any:
    return importlib.import_module(f"longboat.vlm.models.{name}.model")


def _row(family: str, seed: int, images: list[list[int]], videos: list[list[int]] = ()) -> dict:
    """One packed microbatch: a sample of text around each image / video, with labels."""
    cfg = _family(family).flavor("tiny")
    unit = cfg.vision.spatial_merge_size**2
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    bounds = [0]
    for token, grids in ((cfg.image_token_id, images), (cfg.video_token_id, videos)):
        for t, h, w in grids:
            sample = torch.randint(0, 300, (5,), generator=g).tolist()
            sample += [cfg.vision_start_token_id, *[token] * (t * h * w // unit)]
            sample += [cfg.vision_end_token_id, *torch.randint(0, 300, (4,), generator=g).tolist()]
            ids += sample
            bounds.append(len(ids))
    input_ids = torch.tensor([ids])
    loss_mask = ((input_ids != cfg.image_token_id) & (input_ids != cfg.video_token_id)).float()
    for b in bounds[1:]:
        loss_mask[0, b - 1] = 0.0  # no target across a sample boundary
    out = {
        "input_ids": input_ids,
        "labels": torch.roll(input_ids, -1, dims=1),
        "loss_mask": loss_mask,
        "cu_seqlens": bounds,
    }
    for key, grids in (("image", images), ("video", videos)):
        if grids:
            gt = torch.tensor(grids)
            pixels = torch.randn(int(gt.prod(-1).sum()), cfg.vision.patch_dim, generator=g)
            out["pixel_values" if key == "image" else "pixel_values_videos"] = pixels
            out[f"{key}_grid_thw"] = gt
    return out


QWEN25_BATCH = [
    _row("qwen2_5_vl", 0, [[1, 4, 4], [1, 4, 8], [1, 8, 4]]),
    _row("qwen2_5_vl", 1, [[1, 4, 8]]),  # fewer images than TP ranks
    _row("qwen2_5_vl", 2, [[1, 4, 4]], videos=[[2, 4, 4]]),
    _row("qwen2_5_vl", 3, [[1, 8, 8], [1, 4, 4]]),
]
QWEN3_BATCH = [
    _row("qwen3_vl", 4, [[1, 4, 6], [1, 6, 4], [1, 4, 4]]),
    _row("qwen3_vl", 5, [[1, 6, 6]]),
]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    out = {}
    for name, cls in (
        ("qwen2_5_vl", Qwen2_5_VLForConditionalGeneration),
        ("qwen3_vl", Qwen3VLForConditionalGeneration),
    ):
        torch.manual_seed(0)
        model = cls(_family(name).to_hf_config(_family(name).flavor("tiny")))
        with torch.no_grad():  # biases away from 0, so a dropped gradient shows
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.05 * torch.randn_like(p))
        out[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(out[name])
    return out


def _full_state(model: Any, cfg: Any, *, grads: bool) -> dict[str, torch.Tensor]:
    """Every weight (or accumulated gradient) under its HF decoder name / the tower's own
    (collective over TP; empty on ranks that own no tensor)."""
    from longboat.core.megatron.hf_io import gather_hf_state_dict

    swapped = []
    if grads:
        for p in model.parameters():
            if p.requires_grad:
                swapped.append((p, p.data))
                p.data = p.main_grad.view_as(p)
    try:
        out = gather_hf_state_dict([model.language], cfg.language)
        if out:
            out |= {f"visual.{k}": v.detach().clone() for k, v in
                    model.vision.state_dict().items() if isinstance(v, torch.Tensor)}  # fmt: skip
        return out
    finally:
        for p, data in swapped:
            p.data = data


def _train(
    rank: int,
    world: int,
    family: str,
    hf_dir: Path,
    tp: int,
    vision_tp: int | None,
    steps: int,
    batch: list[dict[str, Any]],
    export: Path | None,
) -> dict[str, Any]:
    from megatron.core import parallel_state as mps

    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.vlm.train.step import VLMTrainStep

    fam = _family(family)
    cfg = fam.read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(tensor_parallel=tp), get_accelerator("cpu"))
    try:
        model = fam.build(cfg, vision_tensor_parallel=vision_tp)
        fam.load_hf(model, cfg, hf_dir)
        optim = OptimConfig(lr=LR, weight_decay=0.0, grad_clip=1.0)
        step = VLMTrainStep(model, optim, precision="fp32")
        dp, dp_rank = mps.get_data_parallel_world_size(), mps.get_data_parallel_rank()
        mine = batch[dp_rank::dp]
        out: dict[str, Any] = {"losses": [], "norms": [], "grads": {}}
        for i in range(steps):
            out["losses"].append(float(step.forward_backward(mine)))
            if i == 0 and dp == 1:  # after a DP reduce-scatter each rank holds a shard only
                out["grads"] = _full_state(model, cfg, grads=True)
            out["norms"].append(float(step.update()))
        out["weights"] = _full_state(model, cfg, grads=False)
        out["split"] = model.vision_split is not None
        if export is not None:
            fam.save_hf(model, cfg, export)
        return out
    finally:
        parallel_state.destroy()


def _compare(got: dict[str, Any], ref: dict[str, Any], what: str) -> dict[str, float]:
    diffs = {
        "loss": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)),
        "grad_norm_rel": max(
            abs(a - b) / max(1.0, b) for a, b in zip(got["norms"], ref["norms"], strict=True)
        ),
    }
    for key in ("grads", "weights"):
        if not got[key]:
            continue
        assert set(got[key]) == set(ref[key]), what
        diffs[key] = max((got[key][k] - ref[key][k]).abs().max().item() for k in ref[key])
    for key, diff in diffs.items():
        assert diff < TOL, f"{what}: {key} differs from the single process by {diff:.2e}"
    return diffs


@pytest.fixture(scope="module")
def qwen25_reference(hf_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    export = tmp_path_factory.mktemp("export_tp1")
    args = ("qwen2_5_vl", hf_dirs["qwen2_5_vl"], 1, None, 3, QWEN25_BATCH, export)
    out = run_multiprocess(_train, 1, *args, timeout=300)[0]
    out["export"] = export
    assert out["losses"][-1] < out["losses"][0], "the steps must learn"
    assert any(k.startswith("visual.") and v.abs().max() > 0 for k, v in out["grads"].items())
    return out


@pytest.mark.multiprocess
def test_tp2_vit_tp1_trains_as_one_process(
    hf_dirs: dict[str, Path], qwen25_reference: dict[str, Any], tmp_path: Path
) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    export = tmp_path / "export"
    args = ("qwen2_5_vl", hf_dirs["qwen2_5_vl"], 2, 1, 3, QWEN25_BATCH, export)
    outs = run_multiprocess(_train, 2, *args, timeout=300)
    assert all(out["split"] for out in outs)
    assert sum(bool(out["weights"]) for out in outs) == 1, "one rank owns the full weights"
    for rank, out in enumerate(outs):
        diffs = _compare(out, qwen25_reference, f"TP=2 / ViT TP=1, rank {rank}")
        print(f"TP=2 ViT TP=1 vs one process, rank {rank}: " + ", ".join(
            f"{k} {v:.1e}" for k, v in diffs.items()))  # fmt: skip

    row = {k: v for k, v in QWEN25_BATCH[2].items() if k not in ("labels", "loss_mask")}
    row["attention_mask"] = torch.ones_like(row["input_ids"])
    del row["cu_seqlens"]
    logits = []
    for where in (export, qwen25_reference["export"]):
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(where).eval()
        with torch.no_grad():
            logits.append(model(**row).logits)
    diff = (logits[0] - logits[1]).abs().max().item()
    print(f"export reloaded in transformers: max |dlogit| {diff:.1e}")
    assert diff < 1e-4, f"the TP=2 / ViT TP=1 export's logits differ by {diff:.2e}"


@pytest.mark.multiprocess
def test_tp2_dp2_vit_tp1_trains_as_one_process(
    hf_dirs: dict[str, Path], qwen25_reference: dict[str, Any]
) -> None:
    args = ("qwen2_5_vl", hf_dirs["qwen2_5_vl"], 2, 1, 3, QWEN25_BATCH, None)
    outs = run_multiprocess(_train, 4, *args, timeout=400)
    for rank, out in enumerate(outs):
        diffs = _compare(out, qwen25_reference, f"TP=2 x DP=2 / ViT TP=1, rank {rank}")
        print(f"TP=2 x DP=2 ViT TP=1 vs one process, rank {rank}: " + ", ".join(
            f"{k} {v:.1e}" for k, v in diffs.items()))  # fmt: skip


def _qwen3(
    rank: int, world: int, hf_dir: Path, tp: int, vision_tp: int | None, export: Path | None
) -> dict:
    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.hf_io import rank_coords, tp_shards
    from longboat.vlm.models.qwen3_vl.model import build, load_hf, read_hf_config, save_hf
    from longboat.vlm.train.step import VLMTrainStep

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(tensor_parallel=tp), get_accelerator("cpu"))
    try:
        model = build(cfg, vision_tensor_parallel=vision_tp)
        load_hf(model, cfg, hf_dir)
        if export is not None:
            save_hf(model, cfg, export)
        coords = rank_coords()
        logits = []
        with torch.no_grad():
            for row in QWEN3_BATCH:
                inputs = {k: v for k, v in row.items() if k not in ("labels", "loss_mask")}
                logits.append(torch.cat(tp_shards(model(**inputs), coords), dim=-1))
        step = VLMTrainStep(model, OptimConfig(grad_clip=1.0), precision="fp32")
        loss = float(step.forward_backward(QWEN3_BATCH))
        grads = {k: p.main_grad.clone() for k, p in model.vision.named_parameters()}
        return {"logits": logits, "loss": loss, "tower_grads": grads, "norm": float(step.update())}
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_qwen3_vl_tp2_vit_tp1_equals_tp1(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Deepstack features go through the same exchange as the merged tokens; the export of
    the loaded checkpoint gives back its tensors."""
    from safetensors.torch import load_file

    (ref,) = run_multiprocess(_qwen3, 1, hf_dirs["qwen3_vl"], 1, None, None, timeout=300)
    export = tmp_path / "export"
    outs = run_multiprocess(_qwen3, 2, hf_dirs["qwen3_vl"], 2, 1, export, timeout=300)
    want = load_file(hf_dirs["qwen3_vl"] / "model.safetensors")
    got = load_file(export / "model.safetensors")
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want), "the export changed a tensor"
    assert any(g.abs().max() > 0 for k, g in ref["tower_grads"].items() if "deepstack" in k)
    for rank, out in enumerate(outs):
        logit = max((a - b).abs().max().item() for a, b in zip(out["logits"], ref["logits"]))
        grad = max((out["tower_grads"][k] - g).abs().max().item()
                   for k, g in ref["tower_grads"].items())  # fmt: skip
        loss = abs(out["loss"] - ref["loss"])
        norm = abs(out["norm"] - ref["norm"]) / ref["norm"]
        print(f"Qwen3-VL TP=2 ViT TP=1 vs TP=1, rank {rank}: logits {logit:.1e}, loss "
              f"{loss:.1e}, tower grads {grad:.1e}, grad norm {ref['norm']:.2f} (relative "
              f"{norm:.1e})")  # fmt: skip
        assert max(logit, loss, grad, norm) < TOL, (logit, loss, grad, norm)


def _run(rank: int, world: int, overrides: list[str]) -> list[float]:
    from longboat.core.config.compose import compose_experiment
    from longboat.vlm.train.training import train

    return train(compose_experiment("quickstart", overrides, stack="vlm")).losses


@pytest.mark.multiprocess
def test_run_with_vit_tp1_takes_the_tp2_steps(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``longboat-vlm train`` at TP=2 with ``model.vision_tensor_parallel=1`` (build, steps,
    export) takes the plain TP=2 run's steps and says how the tower is laid out."""
    base = [
        f"data.out_dir={tmp_path / 'data'}", "data.num_train=24", "data.num_eval=4",
        "data.seq_len=256", "train.steps=3", "train.eval_every=0", "logging.progress=false",
        "logging.trackers=[]", "checkpoint.every_steps=0", "vlm.eval_batches=1",
        "parallel.tensor_parallel=2",
    ]  # fmt: skip
    split = run_multiprocess(
        _run, 2, [*base, f"output_dir={tmp_path / 'a'}", "model.vision_tensor_parallel=1"],
        timeout=300,
    )  # fmt: skip
    printed = " ".join(capfd.readouterr().out.split())
    assert "dp=1, ViT tp=1 (data-parallel encoding over the TP group)" in printed
    plain = run_multiprocess(
        _run, 2, [*base, f"output_dir={tmp_path / 'b'}", "export.enabled=false"], timeout=300
    )
    assert "ViT tp=1" not in capfd.readouterr().out
    diff = max(abs(a - b) for a, b in zip(split[0], plain[0], strict=True))
    assert len(split[0]) == 3 and diff < TOL, (split[0], plain[0])
    assert (tmp_path / "a" / "hf" / "config.json").is_file()


def test_image_deal_is_balanced_and_complete() -> None:
    from longboat.vlm.models.qwen2_5_vl.model import flavor

    vis = flavor("tiny").vision
    grid = torch.tensor([[1, 16, 16], [1, 4, 4], [1, 4, 4], [2, 8, 8], [1, 8, 8], [1, 4, 4]])
    deal = assign_images(grid, vis, 2)
    assert sorted(i for r in deal for i in r) == list(range(len(grid)))
    assert deal == assign_images(grid.clone(), vis, 2), "deterministic"
    costs = image_costs(grid, vis)
    loads = sorted(sum(costs[i] for i in r) for r in deal)
    assert deal[0] == (0,), "the largest image alone outweighs the rest"
    assert loads[0] > 0
    # Fewer images than ranks: the others encode nothing.
    assert assign_images(grid[:1], vis, 4) == ((0,), (), (), ())
    # Equal images split evenly.
    even = assign_images(torch.tensor([[1, 4, 4]] * 4), vis, 2)
    assert [len(r) for r in even] == [2, 2]


def test_unsupported_settings_are_refused() -> None:
    from longboat.core.config.errors import ConfigError

    assert resolve_vision_tensor_parallel(None, 4) == 4
    assert resolve_vision_tensor_parallel(4, 4) == 4
    assert resolve_vision_tensor_parallel(1, 4) == 1
    with pytest.raises(ConfigError, match=r"model\.vision_tensor_parallel.*must be null"):
        resolve_vision_tensor_parallel(2, 4)
    with pytest.raises(ConfigError, match=r"model\.vision_tensor_parallel.*pipeline_parallel=2"):
        resolve_vision_tensor_parallel(1, 2, 2)
    with pytest.raises(ConfigError, match=r"model\.vision_tensor_parallel.*llava_onevision"):
        resolve_vision_tensor_parallel(1, 2, family="llava_onevision", supported=False)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["parallel.tensor_parallel=4", "model.vision_tensor_parallel=2"], "must be null"),
        (["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2",
          "model.vision_tensor_parallel=1"], "pipeline_parallel"),
        (["model=llava_onevision_tiny", "parallel.tensor_parallel=2",
          "model.vision_tensor_parallel=1"], "llava_onevision"),
    ],
)  # fmt: skip
def test_run_refuses_before_building(tmp_path: Path, overrides: list[str], match: str) -> None:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.config.errors import ConfigError
    from longboat.vlm.train.training import build_training

    cfg = compose_experiment(
        "quickstart",
        [f"output_dir={tmp_path}", f"data.out_dir={tmp_path / 'data'}", *overrides],
        stack="vlm",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=rf"model\.vision_tensor_parallel.*{match}"):
        build_training(cfg)
    assert not (tmp_path / "data").exists(), "refused before the data was made"
